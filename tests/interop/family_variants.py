"""Small random Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 / Phi-3 checkpoints with the switches the fixtures leave
out (windows shorter than the input, sliding and full layers mixed, tied and untied embeddings,
head_dim != hidden / heads, biases, partial rotary, longrope, bf16 and 4.x-style config keys) and transformers'
fp32 CPU logits for them: the reference for tests/trainer/model_families_test.cpp.

usage: python family_variants.py OUT_DIR
Writes OUT_DIR/<variant>/ (an HF model directory) and OUT_DIR/<variant>/reference.safetensors
(`input_ids` [2, 40] int64, `logits` [2, 40, vocab] fp32, `prefix_logits` of the first 12 positions alone
(longrope's short factors: 12 is within its original context), `greedy`: the 20 tokens greedy
decoding appends to the first 8 ids, and `full_attention_logits`: the same
model with every layer attending to every earlier key, to show that the windows matter).
"""
import copy
import json
import os
import sys

import torch
from safetensors.torch import save_file
from llama_variants import randomize_norms_and_biases
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

# Phi3Config's default ids (pad 32000) lie past this vocabulary.
PHI3_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

# name: (config class, model class, overrides, stored dtype, write transformers 4.x keys)
VARIANTS = {
    # Mistral 7B v0.1's every-layer window, here 8 keys for 40 positions; head_dim 24 != 64 / 4.
    "mistral_window8_head_dim24": (MistralConfig, MistralForCausalLM,
                                   dict(sliding_window=8, head_dim=24, tie_word_embeddings=False),
                                   torch.float32, False),
    # Qwen2: layers 1 and 2 slide over 6 keys (use_sliding_window, max_window_layers 1), tied, bf16.
    "qwen2_layers_from_1_slide_tied_bf16_v4": (Qwen2Config, Qwen2ForCausalLM,
                                               dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                                                    tie_word_embeddings=True),
                                               torch.bfloat16, True),
    # Qwen3: q/k norm with head_dim 32 != 16, attention_bias, explicit layer_types mixing both kinds.
    "qwen3_head_dim32_bias_layer_types": (Qwen3Config, Qwen3ForCausalLM,
                                          dict(head_dim=32, attention_bias=True, sliding_window=5,
                                               use_sliding_window=True,
                                               layer_types=["sliding_attention", "full_attention",
                                                            "sliding_attention"],
                                               tie_word_embeddings=False),
                                          torch.float32, False),
    # Gemma 2: caps low enough to bend the scores and logits (2 and 3), query_pre_attn_scalar 20 !=
    # head_dim 24, an 8-key window on the sliding layers (0 and 2), GeGLU, sandwich norms, tied.
    "gemma2_window8_softcap2_scalar20": (Gemma2Config, Gemma2ForCausalLM,
                                         dict(sliding_window=8, head_dim=24, query_pre_attn_scalar=20,
                                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                              hidden_activation="gelu_pytorch_tanh"),
                                         torch.float32, False),
    # Gemma 3 with transformers 4.x's keys: rope_theta / rope_local_base_freq / rope_scaling (linear x4
    # on full layers), sliding_window_pattern 2 instead of layer_types, a 6-key window, bf16.
    "gemma3_pattern2_linear_rope_bf16_v4": (Gemma3TextConfig, Gemma3ForCausalLM,
                                            dict(sliding_window=6, head_dim=16, query_pre_attn_scalar=16,
                                                 layer_types=["sliding_attention", "full_attention",
                                                              "sliding_attention"],
                                                 rope_parameters={
                                                     "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                        "rope_theta": 1000000.0},
                                                     "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 10000.0}}),
                                            torch.bfloat16, True),
    # Phi-3 with Phi-4-mini's partial rotary (0.75 of head_dim 24 != 64 / 4), an 8-key window, tied.
    "phi3_head_dim24_partial_rotary_window8_tied": (Phi3Config, Phi3ForCausalLM,
                                                    dict(sliding_window=8, head_dim=24, tie_word_embeddings=True, **PHI3_IDS,
                                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                          "partial_rotary_factor": 0.75}),
                                                    torch.float32, False),
    # Phi-3 128k-style longrope with 4.x keys (rope_scaling, partial_rotary_factor and
    # original_max_position_embeddings beside it): pre-trained on 16 positions, extended to 256, so
    # the 40-token input takes the long factors and the 12-token prefix the short ones; window 8, bf16.
    "phi3_longrope_partial_half_window8_bf16_v4": (
        Phi3Config, Phi3ForCausalLM,
        dict(sliding_window=8, original_max_position_embeddings=16, **PHI3_IDS,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "original_max_position_embeddings": 16,
                              "short_factor": [1.0, 1.5, 2.5, 4.0], "long_factor": [1.25, 3.0, 7.0, 16.0]}),
        torch.bfloat16, True),
}


def to_transformers_4_keys(path):
    with open(path) as f:
        config = json.load(f)
    parameters = config.pop("rope_parameters")
    if "full_attention" in parameters:  # Gemma 3
        full, sliding = parameters["full_attention"], parameters["sliding_attention"]
        config["rope_theta"] = full.pop("rope_theta")
        config["rope_local_base_freq"] = sliding["rope_theta"]
        if full.get("rope_type", "default") != "default":
            config["rope_scaling"] = full
        config["sliding_window_pattern"] = 2
    else:
        config["rope_theta"] = parameters.pop("rope_theta")
        if "partial_rotary_factor" in parameters:  # Phi-3 4.x: beside rope_scaling
            config["partial_rotary_factor"] = parameters.pop("partial_rotary_factor")
        if parameters.get("rope_type", "default") == "longrope":
            parameters.pop("original_max_position_embeddings", None)  # 4.x: top-level only
            parameters["type"] = "longrope"  # as Phi-3-mini-128k-instruct writes it
            del parameters["rope_type"]
            config["rope_scaling"] = parameters
    config["torch_dtype"] = config.pop("dtype")
    config.pop("layer_types", None)  # 4.x derived it (use_sliding_window / max_window_layers, sliding_window_pattern)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def main(out_dir):
    torch.manual_seed(0)
    input_ids = torch.randint(0, BASE["vocab_size"], (2, 40))
    for name, (config_class, model_class, overrides, dtype, old_keys) in VARIANTS.items():
        directory = os.path.join(out_dir, name)
        model = model_class(config_class(**{**BASE, **overrides})).to(dtype)
        randomize_norms_and_biases(model)
        model.save_pretrained(directory)
        if old_keys:
            to_transformers_4_keys(os.path.join(directory, "config.json"))
        reloaded = model_class.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            logits = reloaded(input_ids).logits.float().contiguous()
            prefix_logits = reloaded(input_ids[:, :12]).logits.float().contiguous()
        config = copy.deepcopy(reloaded.config)
        if config.model_type.startswith("gemma"):
            # Gemma builds a sliding mask whatever the types, and Gemma 3 picks a layer's rope by its
            # type: keep the types, widen the window past the input.
            config.sliding_window = 4096
        else:
            config.sliding_window = None
            if hasattr(config, "layer_types"):
                config.layer_types = ["full_attention"] * config.num_hidden_layers
        full = model_class(config).to(torch.float32)
        full.load_state_dict(reloaded.state_dict())
        with torch.no_grad():
            full_attention_logits = full(input_ids).logits.float().contiguous()
        # Greedy decoding from 8 tokens to 28, past a longrope model's 16-position original context,
        # each token from the whole sequence's forward (no cache). transformers 5.17's generate() leaves
        # that at longrope's switch (its Phi-3 drops the cache there, and the next token differs from
        # the uncached forward's); qtrain's cached decoding must give the uncached tokens.
        sequence = input_ids[:1, :8]
        with torch.no_grad():
            for _ in range(20):
                sequence = torch.cat([sequence, reloaded(sequence).logits[:, -1].argmax(-1, keepdim=True)], 1)
        greedy = sequence[0, 8:].contiguous()
        save_file({"input_ids": input_ids, "logits": logits, "prefix_logits": prefix_logits,
                   "full_attention_logits": full_attention_logits, "greedy": greedy},
                  os.path.join(directory, "reference.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
