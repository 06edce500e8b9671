#!/bin/bash
# lmzoo on a Ray cluster: one process per host with `zoo launch ray`, submitted as a Ray job from a folder holding
# run.yaml (--working-dir uploads it; every process starts in it). lmzoo[ray,gcs] is installed on every node. Here
# 4 TPU VM hosts of 4 chips each; on GPUs, e.g. --gpus-per-process 8 instead of --resources.
set -euo pipefail
ray job submit --address http://ray-head:8265 --working-dir . -- \
  zoo launch ray --num-processes 4 --resources '{"TPU": 4}' --strategy STRICT_SPREAD -- \
  pretrain train --config run.yaml output_dir=gs://my-bucket/runs/pt1
