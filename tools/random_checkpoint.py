#!/usr/bin/env python3
"""A Llama-3-8B-shaped Hugging Face checkpoint with random bf16 weights, for benchmarks of the
real training command (`qtrain --recipe`) where `qtrain bench` is not enough (several ranks).

    tools/random_checkpoint.py OUT_DIR [--device cuda] [--layers N]

Writes config.json (Meta-Llama-3-8B's), model-0000K-of-0000N.safetensors shards of about 5 GB
with model.safetensors.index.json, and the bundled tiny model's tokenizer files (its ids all lie
inside the 128,256-token vocabulary, so speed is all they are good for). Weights are drawn as
N(0, 0.02), norms are ones; the tensors are made on --device (fast on a GPU) one at a time.
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER_DIR = os.path.join(ROOT, "recipes/demo/tiny-llama")

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "attention_bias": False,
    "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 4,
}


def tensor_shapes(config):
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_width = config["num_attention_heads"] * config["head_dim"]
    kv_width = config["num_key_value_heads"] * config["head_dim"]
    yield "model.embed_tokens.weight", [config["vocab_size"], hidden]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", [hidden]
        yield f"{prefix}.self_attn.q_proj.weight", [q_width, hidden]
        yield f"{prefix}.self_attn.k_proj.weight", [kv_width, hidden]
        yield f"{prefix}.self_attn.v_proj.weight", [kv_width, hidden]
        yield f"{prefix}.self_attn.o_proj.weight", [hidden, q_width]
        yield f"{prefix}.post_attention_layernorm.weight", [hidden]
        yield f"{prefix}.mlp.gate_proj.weight", [inter, hidden]
        yield f"{prefix}.mlp.up_proj.weight", [inter, hidden]
        yield f"{prefix}.mlp.down_proj.weight", [hidden, inter]
    yield "model.norm.weight", [hidden]
    yield "lm_head.weight", [config["vocab_size"], hidden]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    parser.add_argument("--shard-bytes", type=int, default=5 * 10**9)
    args = parser.parse_args()
    config = dict(CONFIG, num_hidden_layers=args.layers)
    os.makedirs(args.out, exist_ok=True)

    generator = torch.Generator(device=args.device).manual_seed(0)
    shards, shard, shard_bytes = [], {}, 0
    for name, shape in tensor_shapes(config):
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(shape, dtype=torch.bfloat16, device=args.device).normal_(0, 0.02, generator=generator)
        shard[name] = tensor.cpu()
        shard_bytes += tensor.numel() * 2
        if shard_bytes >= args.shard_bytes:
            shards.append(shard)
            shard, shard_bytes = {}, 0
    if shard:
        shards.append(shard)

    weight_map, total = {}, 0
    for index, tensors in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(args.out, file_name), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file_name
            total += tensor.numel() * 2
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as file:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file, indent=1)
    with open(os.path.join(args.out, "config.json"), "w") as file:
        json.dump(config, file, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(TOKENIZER_DIR, name), args.out)
    print(f"random_checkpoint: {args.out}: {len(shards)} shards, {total / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
