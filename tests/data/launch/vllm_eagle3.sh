#!/bin/sh
# vLLM serving the shipped pair, drafter in the speculators format (top-level ids, vLLM's 'input' reading)
vllm serve ../../../eagle3_ops/assets/byte-small/target \
    --speculative-config '{"method": "eagle3", "model": "../byte-small-formats/vllm-speculators", "num_speculative_tokens": 3}'
