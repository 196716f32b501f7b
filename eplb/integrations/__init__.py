"""Engine plug-ins: eplb's placement inside vLLM (`eplb.integrations.vllm`) and SGLang
(`eplb.integrations.sglang`), solved in the engine's process or by the eplb service (`core`).

Importing this package needs neither torch nor an engine; the engine modules import torch inside the
calls the engine makes. docs/integrations.md ("Engine plug-ins") says how to install, enable, check and
remove each one.
"""
