#!/usr/bin/env bash
# scripts/device_tree.sh out|back|size
#
# The working tree a device call sends is capped at 64 MiB (tracked files, untracked files git does
# not ignore, and the carried paths); the embedded target's weights alone are ~82 MB, and the GPU
# check (scripts/gpu_check.sh) needs none of them. For the duration of one call only:
#   out   moves the large tracked weights to $HOLD (default /tmp/moe_spec_held) and takes them out
#         of the index, then prints the size that would travel (it fails above the cap)
#   back  puts them back into the tree and the index, exactly as committed
#   size  prints the size that would travel, .whl included (it fails above the cap)
# Never commit between `out` and `back`: the commit would delete the weights from main.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
HOLD=${HOLD:-/tmp/moe_spec_held}
LARGE=(moe_spec/assets/default_target/model-00001-of-00002.safetensors)  # the main weights (the MTP layer is the small second shard)
CAP=$((64 * 1024 * 1024))

size() {
  local bytes
  bytes=$( { git ls-files -z --cached --others --exclude-standard; [[ -d .whl ]] && find .whl -type f -print0; } \
    | while IFS= read -r -d '' f; do [[ -f $f ]] && stat -c %s "$f"; done | awk '{s += $1} END {print s + 0}')
  echo "travelling tree: $((bytes / 1024 / 1024)) MiB (cap 64 MiB)"
  (( bytes <= CAP ))
}

case ${1:-} in
  out)
    mkdir -p "$HOLD"
    for f in "${LARGE[@]}"; do
      [[ -f $f ]] || { echo "$f is not in the tree (already out?)" >&2; exit 1; }
      mkdir -p "$HOLD/$(dirname "$f")" && mv "$f" "$HOLD/$f" && git rm -q --cached "$f"
    done
    size ;;
  back)
    for f in "${LARGE[@]}"; do
      [[ -f $HOLD/$f ]] && mv "$HOLD/$f" "$f"
      git reset -q HEAD -- "$f"
      git diff --quiet -- "$f" || { echo "$f differs from the committed file" >&2; exit 1; }
    done
    echo "weights back: $(git status --short -- "${LARGE[@]}" | wc -l) changed" ;;
  size) size ;;
  *) echo "usage: $0 out|back|size" >&2; exit 2 ;;
esac
