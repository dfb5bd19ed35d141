"""Llama (LlamaForCausalLM): llama.cpp's "llama", its q / k rows permuted for llama.cpp's rotary layout;
llama-3's rope scaling as the rope_freqs tensor (arch.rope_freqs)."""

from .base import Arch, register

register(Arch("llama", "llama", "LlamaForCausalLM", permute_qk=True))
