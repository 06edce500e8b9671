#!/bin/bash
# lmzoo on a TPU VM slice: one process per host, the same command on every host (`--worker=all`). Here a v5p-32
# (16 chips, topology 2x2x4: 4 hosts of 4 chips), from a checkout holding run.yaml: `bash docs/recipes/tpu-vm.sh`.
set -euo pipefail
NAME=lmzoo-v5p ZONE=us-east5-a
gcloud compute tpus tpu-vm create "$NAME" --zone "$ZONE" --accelerator-type v5p-32 --version v2-alpha-tpuv5

# Every host gets the wheel and the run's config; lmzoo needs Python 3.11 or later (uv brings one).
pip wheel --no-deps . -w dist
gcloud compute tpus tpu-vm scp dist/lmzoo-0.1.0-py3-none-any.whl run.yaml "$NAME": --zone "$ZONE" --worker=all
gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command \
  "pip install -q uv && ~/.local/bin/uv venv -q -p 3.12 lmzoo && ~/.local/bin/uv pip install -q -p lmzoo/bin/python 'lmzoo-0.1.0-py3-none-any.whl[tpu,gcs]'"

# --distributed: JAX finds the slice's hosts, this host's index and the coordinator (host 0) from the TPU VM's
# metadata. The hosts share no filesystem: output_dir is a bucket they all write.
gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker=all --command \
  "lmzoo/bin/pretrain train --config run.yaml output_dir=gs://my-bucket/runs/pt1 --distributed"
