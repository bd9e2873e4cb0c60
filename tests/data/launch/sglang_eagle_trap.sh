#!/bin/sh
# the seed deployment's trap: EAGLE (EAGLE-2, no aux capture) for an EAGLE-3 drafter; argparse takes the prefix
python3 -m sglang.launch_server --model-path ../../../eagle3_ops/assets/byte-small/target \
    --speculative-algo EAGLE --speculative-draft-model-path ../byte-small-formats/sglang \
    --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
