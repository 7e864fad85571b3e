#!/bin/bash
# Builds what the Megatron-DeepSpeed example scripts (examples/megatron_deepspeed_*.sh) and their opt-in
# tests need, outside the repository, and prints the four variables to export. Idempotent: each part is
# skipped when it is already there.
#
# usage: examples/megatron_deepspeed_env.sh [DIR]   (DIR defaults to /work/mds-env)
#   MDS    = DIR/megatron-deepspeed: a copy of the pinned client (../shared/clients/megatron-deepspeed, or
#            $DS_EXT_CLIENTS/megatron-deepspeed), unmodified; its data helpers (megatron/data/helpers.cpp)
#            are compiled into that copy, which is why it is a copy
#   DS0196 = DIR/ds0196: deepspeed 0.19.6 (the client imports deepspeed.compression.compress, removed in
#            0.19.7), no ops built
#   EXTRA  = DIR/extra: nltk (tools/preprocess_data.py), pybind11 (helpers.cpp) and an import-only
#            torchvision stand-in: the client imports torchvision.transforms, torchvision.datasets
#            (VisionDataset as a base class) and torchvision.get_image_backend through its vision code
#            (megatron/training.py -> model/vision/knn_monitor.py -> data/vit_dataset.py, image_folder.py);
#            nothing of it runs for GPT, and the registry's torchvision wheels do not load against a CPU torch
#   DATA   = DIR/data/tiny_text_document: 400 documents of 20-200 random token ids below 500, preprocessed
#            by the client's tools/preprocess_data.py (NullTokenizer, vocabulary 512, an EOD appended)
set -euo pipefail
dir=${1:-/work/mds-env}
repo=$(cd "$(dirname "$0")/.." && pwd)
clients=${DS_EXT_CLIENTS:-$repo/../shared/clients}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
mds=$dir/megatron-deepspeed ds=$dir/ds0196 extra=$dir/extra data=$dir/data

if [ ! -f "$mds/pretrain_gpt.py" ]; then
  [ -f "$clients/megatron-deepspeed/pretrain_gpt.py" ] || { echo "no client at $clients/megatron-deepspeed" >&2; exit 1; }
  cp -r "$clients/megatron-deepspeed" "$mds"
fi
if [ ! -f "$ds/deepspeed/__init__.py" ]; then
  DS_BUILD_OPS=0 pip install --no-build-isolation --no-deps --target "$ds" deepspeed==0.19.6
fi
if [ ! -d "$extra/nltk" ] || [ ! -d "$extra/pybind11" ]; then
  pip install --target "$extra" nltk pybind11
fi
if [ ! -f "$extra/torchvision/__init__.py" ]; then
  mkdir -p "$extra/torchvision"
  cat > "$extra/torchvision/__init__.py" <<'PY'
"""Import-only stand-in for torchvision (Megatron-DeepSpeed imports it through its vision code; GPT never calls it)."""
from . import datasets, transforms  # noqa: F401


def get_image_backend():
    raise NotImplementedError("torchvision stand-in: no image support")
PY
  cat > "$extra/torchvision/datasets.py" <<'PY'
"""Import-only stand-in: megatron/data/image_folder.py subclasses VisionDataset."""


class VisionDataset:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("torchvision stand-in: no image datasets")
PY
  cat > "$extra/torchvision/transforms.py" <<'PY'
"""Import-only stand-in: megatron/data/vit_dataset.py uses these names only inside functions."""


def __getattr__(name):
    raise NotImplementedError(f"torchvision stand-in: transforms.{name} is not available")
PY
fi

pp="$ds:$extra:$mds"
# the data helpers, compiled once into the copy (the client would run the same make at start on rank 0)
if ! ls "$mds"/megatron/data/helpers*.so >/dev/null 2>&1; then
  (cd "$mds/megatron/data" && PYTHONPATH="$pp" make)
fi
if [ ! -f "$data/tiny_text_document.bin" ]; then
  mkdir -p "$data"
  python - "$data/tiny.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(400):
        f.write(json.dumps({"text": " ".join(str(rng.randrange(500)) for _ in range(rng.randint(20, 200)))}) + "\n")
PY
  (cd "$mds" && PYTHONPATH="$pp" DS_ACCELERATOR=cpu python tools/preprocess_data.py --input "$data/tiny.jsonl" \
     --output-prefix "$data/tiny" --tokenizer-type NullTokenizer --vocab-size 512 --append-eod --workers 1)
fi
[ -f "$data/tiny_text_document.bin" ] || { echo "preprocessing left no $data/tiny_text_document.bin" >&2; exit 1; }
echo "export MDS=$mds DS0196=$ds EXTRA=$extra DATA=$data/tiny_text_document"
