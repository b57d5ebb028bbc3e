"""`scripts/routing_ahead.py`: the eviction replay counts reads as a cache of C would, Belady's
offline choice never reads more than LRU, and both questions run on the embedded pair."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("routing_ahead", ROOT / "scripts" / "routing_ahead.py")
routing_ahead = importlib.util.module_from_spec(spec)
spec.loader.exec_module(routing_ahead)


def test_the_replayed_cache_reads_what_each_eviction_would():
    passes = [{0, 1}, {2}, {0}, {1}, {2}, {0}]  # C = 2
    # LRU: 0,1 | 2 evicts 0 | 0 evicts 1 | 1 evicts 2 | 2 evicts 0 | 0 evicts 1
    assert routing_ahead.reads(passes, 2, "lru") == 7
    # Belady: 0,1 | 2 evicts 1 (used later than 0) | 0 hit | 1 evicts 0 (next used after 2) | 2 hit | 0 evicts
    assert routing_ahead.reads(passes, 2, "belady") == 5
    assert routing_ahead.reads([{0, 1, 2}], 2, "lru") == 3, "beyond the slots: read, not kept"
    assert routing_ahead.reads([{0, 1, 2}, {2}], 2, "lru") == 4


def test_both_questions_run_on_the_embedded_pair(capsys):
    assert routing_ahead.main(["eviction", "--limit", "1", "--max-new-tokens", "6", "--resident-experts", "8"]) == 0
    eviction = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    reads = eviction["reads"]
    assert reads["belady"]["per_token"] <= reads["lfu"]["per_token"] and reads["belady"]["per_token"] <= reads["lru"]["per_token"]
    assert routing_ahead.main(["pregate", "--limit", "1", "--max-new-tokens", "6", "--nodes", "2"]) == 0
    pregate = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(pregate["layers"]) == {str(layer) for layer in range(2, 9)}
    assert all(0 <= row["recall"] <= 1 and 0 <= row["precision"] <= 1 for row in pregate["layers"].values())
