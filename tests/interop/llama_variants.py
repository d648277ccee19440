"""Builds small random Llama checkpoints that exercise config.json variants and records
transformers' fp32 CPU logits for them: the reference for tests/trainer/llama_variants_test.cpp.

usage: python llama_variants.py OUT_DIR
Writes OUT_DIR/<variant>/ (an HF model directory) and OUT_DIR/<variant>/reference.safetensors
(`input_ids` [2, 48] int64, `logits` [2, 48, vocab] fp32).
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5)

# name: (config overrides, stored dtype, config.json style, shard size)
VARIANTS = {
    "gqa_bias_tied_v4": (dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                         torch.float32, "4.x", None),
    "mqa_llama3_sharded": (dict(num_key_value_heads=1, rope_parameters={
                               "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
                           torch.bfloat16, "5.x", "100KB"),
    "linear_rope_fp16_v4": (dict(num_key_value_heads=4, rope_parameters={
                                "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
                            torch.float16, "4.x", None),
    "dynamic_rope": (dict(num_key_value_heads=2, max_position_embeddings=32, rope_parameters={
                         "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
                     torch.float32, "5.x", None),
}


def randomize_norms_and_biases(model):
    """Non-trivial norms and biases (ones and zeros by default), so every tensor matters."""
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name or "bias" in parameter_name:
                parameter.normal_(1.0 if "norm" in parameter_name else 0.0, 0.1)


def to_transformers_4_keys(path):
    """Rewrites a 5.x config.json the way transformers 4.x wrote it."""
    with open(path) as f:
        config = json.load(f)
    parameters = config.pop("rope_parameters")
    config["rope_theta"] = parameters.pop("rope_theta")
    rope_type = parameters.pop("rope_type")
    if rope_type != "default":
        config["rope_scaling"] = dict(parameters, type=rope_type)
    config["torch_dtype"] = config.pop("dtype")
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def main(out_dir):
    torch.manual_seed(0)
    input_ids = torch.randint(0, BASE["vocab_size"], (2, 48))
    for name, (overrides, dtype, style, shard_size) in VARIANTS.items():
        directory = os.path.join(out_dir, name)
        model = LlamaForCausalLM(LlamaConfig(**{**BASE, **overrides})).to(dtype)
        randomize_norms_and_biases(model)
        model.save_pretrained(directory, **({"max_shard_size": shard_size} if shard_size else {}))
        if style == "4.x":
            to_transformers_4_keys(os.path.join(directory, "config.json"))
        reloaded = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa")
        with torch.no_grad():
            logits = reloaded(input_ids).logits.float().contiguous()
        save_file({"input_ids": input_ids, "logits": logits}, os.path.join(directory, "reference.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
