"""The selection ceiling is the exact optimum over per-step choices, and no policy beats it."""

import itertools
import random

from moe_spec.experiments.bounds import selection_ceiling


def _rate(options, picks):
    return sum(o[i][0] for o, i in zip(options, picks)) / sum(o[i][1] for o, i in zip(options, picks))


def test_dinkelbach_finds_the_brute_force_optimum_of_the_ratio_of_sums():
    rng = random.Random(0)
    for _ in range(200):
        options = []
        for _ in range(rng.randint(1, 4)):
            ms = 5.0 + rng.uniform(0, 5)
            steps = [(1, ms, (0,))]
            for k in range(1, rng.randint(1, 5)):
                ms += rng.uniform(0.1, 8.0)  # each further path node costs more verify time
                steps.append((k + 1, ms, tuple(range(k + 1))))
            options.append(steps)
        best = max(_rate(options, picks) for picks in itertools.product(*[range(len(o)) for o in options]))
        assert abs(_rate(options, selection_ceiling(options)) - best) < 1e-12


def test_cheap_path_nodes_are_all_taken_and_dear_ones_dropped():
    cheap = [[(1, 10.0, (0,)), (2, 10.5, (0, 1)), (3, 11.0, (0, 1, 2))]]
    dear = [[(1, 10.0, (0,)), (2, 30.0, (0, 1))]]
    assert selection_ceiling(cheap) == [2]
    assert selection_ceiling(dear) == [0]
