"""Files in and out of eplb, one module per concept:

- `windows`: load windows `[layers, E]` (what `eplb solve --loads` reads);
- `logs`: routing logs, per-step counts or top-k ids, streamed (replay, compare, `eplb logs`);
- `exports`: placements written for SGLang, TensorRT-LLM and vllm-ascend (`eplb export`);
- `foreign`: placements read from those systems' files and ours (`--current`, `--placement`);
- `statistics`: load statistics recorded by SGLang, TensorRT-LLM and vLLM (`eplb import-load`);
- `files`: the checks every reader shares (existing files, JSON, rectangular integer tables).
"""
