#!/bin/sh
# SGLang serving the shipped pair as EAGLE-3 (SGLang's documented speculative flags); paths from this folder
python3 -m sglang.launch_server --model-path ../../../eagle3_ops/assets/byte-small/target \
    --speculative-algorithm EAGLE3 \
    --speculative-draft-model-path ../byte-small-formats/sglang \
    --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
