"""CogVLM (CogVLMForCausalLM): an architecture llama.cpp has ("cogvlm") and qconv refuses to write, with
the reason read from the checkpoint's tensors."""

from __future__ import annotations

from .base import Unwritten, register_unwritten


def _why(names) -> list[str]:
    """Why llama.cpp (llama-cpp-python 0.3.36's build) cannot compute a CogVLM checkpoint, from its tensors."""
    why = []
    if any(n.startswith("model.vision.conv.") for n in names):
        why.append("its vision tower's 2x2 convolution after the transformer (model.vision.conv, CogVLM2's) has no "
                   "place in llama.cpp's cogvlm clip graph (tools/mtmd/models/cogvlm.cpp)")
    if any(n.endswith(".vision_expert_query_key_value.bias") for n in names):
        why.append("llama.cpp's cogvlm text model loads no bias for the vision expert's query_key_value "
                   "(vis_attn_qkv, src/models/cogvlm.cpp), which this checkpoint has")
    return why or ["qconv has no CogVLM checkpoint made by CogVLM's own code to prove one against"]


register_unwritten(Unwritten("CogVLMForCausalLM", "CogVLM", _why))
