#!/usr/bin/env python3
"""The Unsloth anchor of `qtrain bench`: the same training step in Unsloth, same shape and settings,
so that the two can be compared on one GPU (tools/bench.sh).

Unsloth loads from disk, so the first run writes a random bf16 checkpoint and later runs reuse it.
llama3-8b: tools/random_checkpoint.py's Llama-3-8B shape, with a tokenizer of its 128,256 ids, into
$QTRAIN_BENCH_CHECKPOINT (default /tmp/qtrain-bench-llama3-8b, about 16 GB; with --layers N < 32,
that path + "-LN"). llama3-70b (--quant qlora only): its Llama-3-70B shape written already NF4 by
bitsandbytes (random_checkpoint.py --bnb-4bit, about 39 GB where bf16 would be 141), into
$QTRAIN_BENCH_CHECKPOINT_DIR/qtrain-bench-llama3-70b (+ "-LN"), which Unsloth loads as a "bnb-4bit"
model. The other dense shapes of `qtrain bench` (qwen3-8b, qwen2.5-7b, mistral-7b,
phi4-mini, gemma2-9b, gemma3-12b, llama3-1b, tiny): the published config.json with the keys of
qtrain's shape (trainer/model/families/*.cpp), all layers unless --layers N (bf16 on disk: 16.4,
15.2, 14.5, 7.7, 18.5, 23.5, 2.5 GB). qwen3-30b-a3b, gpt-oss-20b (mixtures of experts): the real
config.json (gpt-oss with bf16 experts instead of its MXFP4) cut to --layers N, default 12, as the
whole bf16 checkpoints (61 / 42 GB) do not fit the GPU machine's 64 GB disk; at 12 layers about
16 / 22 GB. These are built with transformers' own init (std 0.02) on the GPU in a separate process
(Unsloth not imported there, its memory gone before the load), with a tokenizer holding the model's
real special tokens at their ids (and a pad that is not the eos), into $QTRAIN_BENCH_CHECKPOINT_DIR
(default /tmp) as ubench_<family>_L<N>: no model name in the path, since Unsloth special-cases names.
Before writing a checkpoint the script deletes the others it wrote (ubench_*, and the llama3-8b ones
where $QTRAIN_BENCH_CHECKPOINT is not set), so that the disk holds one; QTRAIN_BENCH_KEEP_CHECKPOINTS=1
keeps them. `--shape S --layers N --write-checkpoint` only writes S's checkpoint (no GPU needed).

Unsloth's own recipe: FastLanguageModel.from_pretrained (load_in_4bit for QLoRA, NF4),
get_peft_model with LoRA r16 alpha 32 dropout 0 on the 7 projections (phi4-mini: their fused
qkv_proj, o_proj, gate_up_proj, down_proj; for the mixtures Unsloth adds the fused expert Parameters
as peft target_parameters), its default use_gradient_checkpointing="unsloth" (which offloads
activations to the host) with --checkpointing and False without; then a plain loop on random token
ids: forward with labels under bf16 autocast, backward, clipping at 1, torch AdamW lr 1e-4 on the
LoRA weights. Prints the median step's tokens/s and the peak allocated memory of the timed steps
(reset after warm-up, as qtrain bench does), and with --json one JSON object (with "oom" on running
out of memory, "error" where it could not run; for the mixtures also what was quantized to 4 bits
and what got LoRA, by name pattern).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback

from bench_arguments import add_row_arguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT = os.path.abspath(os.environ.get("QTRAIN_BENCH_CHECKPOINT", "/tmp/qtrain-bench-llama3-8b"))
CHECKPOINT_DIR = os.path.abspath(os.environ.get("QTRAIN_BENCH_CHECKPOINT_DIR", "/tmp"))
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Phi-3 / Phi-4's attention and MLP projections, fused as transformers' Phi3 model has them (and qtrain's
# fused_projections): the same 7 projections under their 4 names.
FUSED_PROJECTIONS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
LLAMA_LAYERS = 32
# The shapes written by tools/random_checkpoint.py: their layers, and its flags beyond --layers.
RANDOM_SHAPES = {"llama3-8b": dict(full_layers=LLAMA_LAYERS, flags=[]),
                 "llama3-70b": dict(full_layers=80, flags=["--shape", "llama3-70b", "--bnb-4bit"])}
MOE_DEFAULT_LAYERS = 12
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                 "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
                 "</tool_response>", "<think>", "</think>"]


def qwen_tokenizer(count, byte_alphabet=False, **named):
    """Qwen's tokenizer: 151,643 ordinary ids, then its first COUNT special tokens."""
    return dict(size=151643 + count, specials={151643 + i: token for i, token in enumerate(QWEN_SPECIALS[:count])},
                named=named, byte_alphabet=byte_alphabet)


def byte_characters():
    """Byte-level BPE's 256 characters for the bytes, in GPT-2's order (Qwen's ids 0-255)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    return [chr(b) for b in printable] + [chr(256 + n) for n in range(256 - len(printable))]


def gemma_tokenizer(size, turn, extra=None):
    """Gemma's tokenizer of SIZE ids: <pad> <eos> <bos> <unk> <mask> first, 99 <unusedN>, the turn markers at TURN."""
    head = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + (["<2mass>"] if turn == 106 else []) + ["[@BOS@]"]
    specials = dict(enumerate(head))
    specials.update({turn - 99 + i: f"<unused{i}>" for i in range(99)})
    specials.update({turn: "<start_of_turn>", turn + 1: "<end_of_turn>"})
    specials.update(extra or {})
    return dict(size=size, specials=specials,
                named=dict(pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"))


# The shapes written with transformers' own init (write_built_checkpoint). tag: the checkpoint's directory
# (ubench_<tag>_L<N>); classes: transformers' config and model; tokenizer: its size, its special tokens at
# their real ids, which of them are bos / eos / pad / unk (the other ids are placeholders; the bench feeds
# random ids); targets: the LoRA projections where not PROJECTIONS.
#
# The dense shapes: the keys of qtrain's bench shape (trainer/model/families/*.cpp, each the published
# config.json less what leaves the work unchanged), plus the published token ids, initializer_range and
# dropouts. Built with config_class.from_dict as from_pretrained reads a config.json (rope_theta,
# rope_scaling, partial_rotary_factor, rope_local_base_freq, sliding_window_pattern as published).
DENSE_SHAPES = {
    # Qwen/Qwen3-8B config.json (trainer/model/families/qwen3.cpp)
    "qwen3-8b": dict(full_layers=36, tag="qwen3", classes=("Qwen3Config", "Qwen3ForCausalLM"), config=dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000, rope_scaling=None,
        attention_bias=False, attention_dropout=0.0, sliding_window=None, use_sliding_window=False,
        max_window_layers=36, hidden_act="silu", tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645, initializer_range=0.02),
        tokenizer=qwen_tokenizer(26, eos_token="<|im_end|>", pad_token="<|endoftext|>")),
    # Qwen/Qwen2.5-7B config.json (qwen2.cpp); q, k and v with biases, as transformers' Qwen2 always has.
    # Its tokenizer pads with its eos, <|endoftext|>; here <|vision_pad|> pads (Unsloth would pick a
    # pad other than the eos itself, and must not add one: that resizes the embeddings). transformers 5
    # loads a qwen2 model's tokenizer as Qwen2Tokenizer, a byte-level BPE rebuilt from the vocabulary:
    # ids 0-255 are the byte characters, as in Qwen's, so that text encodes (byte by byte) there too.
    "qwen2.5-7b": dict(full_layers=28, tag="qwen25", classes=("Qwen2Config", "Qwen2ForCausalLM"), config=dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=131072,
        use_sliding_window=False, max_window_layers=28, attention_dropout=0.0, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643, initializer_range=0.02),
        tokenizer=qwen_tokenizer(22, byte_alphabet=True, eos_token="<|endoftext|>", pad_token="<|vision_pad|>")),
    # mistralai/Mistral-7B-v0.3 config.json (mistral.cpp: no sliding window, 32,768 ids). Its tokenizer
    # has no pad; [control_8] pads here (as Unsloth picks a "[control" token for Mistral).
    "mistral-7b": dict(full_layers=32, tag="mistral", classes=("MistralConfig", "MistralForCausalLM"), config=dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
        attention_dropout=0.0, hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        initializer_range=0.02),
        tokenizer=dict(size=32768, specials={
            **dict(enumerate(["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                              "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"])),
            **{10 + i: f"[control_{8 + i}]" for i in range(761)}},
            named=dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="[control_8]"))),
    # microsoft/Phi-4-mini-instruct config.json less its longrope rope_scaling and its sliding_window of
    # 262,144 (phi3.cpp drops both: the same work; no window, so no mask beside the causal one) and its
    # auto_map (remote code). Fused qkv_proj and gate_up_proj, tied embeddings, 96 of 128 dims rotated.
    # Its tokenizer: o200k's 199,998 ids, <|endoftext|> at 199,999 (bos, eos and pad), <|endofprompt|>
    # at 200,018, the chat tokens to 200,028; the unused ids between are <|dummy_N|> here, and one pads.
    "phi4-mini": dict(full_layers=32, tag="phi3", classes=("Phi3Config", "Phi3ForCausalLM"),
                      targets=FUSED_PROJECTIONS, config=dict(
        vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
        max_position_embeddings=131072, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, partial_rotary_factor=0.75, sliding_window=None, attention_bias=False,
        hidden_act="silu", embd_pdrop=0.0, resid_pdrop=0.0, attention_dropout=0.0, tie_word_embeddings=True,
        bos_token_id=199999, eos_token_id=199999, pad_token_id=199999, initializer_range=0.02),
        tokenizer=dict(size=200029, specials={
            199998: "<|dummy_0|>", 199999: "<|endoftext|>", **{200000 + i: f"<|dummy_{1 + i}|>" for i in range(18)},
            **dict(enumerate(["<|endofprompt|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>", "<|tool|>",
                              "<|/tool|>", "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>", "<|tag|>"],
                             start=200018))},
            named=dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|dummy_1|>"))),
    # google/gemma-2-9b config.json (gemma2.cpp; tie_word_embeddings, which it leaves to the default, written).
    # Sliding (4,096 keys) and full layers alternate, from layer_types' default.
    "gemma2-9b": dict(full_layers=42, tag="gemma2", classes=("Gemma2Config", "Gemma2ForCausalLM"), config=dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
        attention_dropout=0.0, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2, initializer_range=0.02),
        tokenizer=gemma_tokenizer(256000, 106)),
    # google/gemma-3-12b-pt's text_config with Gemma3TextConfig's defaults written out (gemma3.cpp): five
    # sliding layers (1,024 keys, rope 10k) in six, the sixth full (rope 1M, linear x8); Gemma3ForCausalLM.
    "gemma3-12b": dict(full_layers=48, tag="gemma3", classes=("Gemma3TextConfig", "Gemma3ForCausalLM"), config=dict(
        vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8,
        head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_local_base_freq=10000.0, attention_bias=False,
        attention_dropout=0.0, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
        attn_logit_softcapping=None, final_logit_softcapping=None, sliding_window=1024, sliding_window_pattern=6,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2, initializer_range=0.02),
        tokenizer=gemma_tokenizer(262145, 105, {255999: "<start_of_image>", 256000: "<end_of_image>",
                                                262144: "<image_soft_token>"})),
    # meta-llama/Llama-3.2-1B config.json less its llama3 rope_scaling, as llama.cpp's kLlama3_1b.
    "llama3-1b": dict(full_layers=16, tag="llama1b", classes=("LlamaConfig", "LlamaForCausalLM"), config=dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False,
        mlp_bias=False, attention_dropout=0.0, hidden_act="silu", tie_word_embeddings=True, bos_token_id=128000,
        eos_token_id=128001, initializer_range=0.02),
        tokenizer=dict(size=128256, specials={128000 + i: token for i, token in enumerate(
            ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(254)])},
            named=dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                       pad_token="<|reserved_special_token_2|>"))),
    # llama.cpp's kTiny (the tests' tiny-llama fixture's shape, a 688-wide MLP): seconds, a smoke test.
    "tiny": dict(full_layers=4, tag="tiny", classes=("LlamaConfig", "LlamaForCausalLM"), config=dict(
        vocab_size=8192, hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, initializer_range=0.02),
        tokenizer=dict(size=8192, specials={0: "<|begin_of_text|>", 1: "<|end_of_text|>", 2: "<|pad|>"},
                       named=dict(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|pad|>"))),
}
# The mixtures of experts (as .gpu/unsloth_moe_bench.py): their config.json, the transformers classes.
MOE_SHAPES = {
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": dict(full_layers=48, tag="qwen3moe", classes=("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), config=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False, attention_dropout=0.0,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False, use_sliding_window=False,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645, initializer_range=0.02),
        tokenizer=qwen_tokenizer(26, eos_token="<|im_end|>", pad_token="<|endoftext|>")),
    # openai/gpt-oss-20b config.json (bf16 instead of its MXFP4 experts)
    "gpt-oss-20b": dict(full_layers=24, tag="gptoss", classes=("GptOssConfig", "GptOssForCausalLM"), config=dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                            "original_max_position_embeddings": 4096},
        attention_bias=True, attention_dropout=0.0, router_aux_loss_coef=0.9, output_router_logits=False,
        tie_word_embeddings=False, eos_token_id=200002, pad_token_id=199999, initializer_range=0.02),
        tokenizer=dict(size=200019, specials={i: {
            199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
            200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>"
        }.get(i, f"<|reserved_{i}|>") for i in range(199998, 200019)},
            named=dict(bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>"))),
}
BUILT_SHAPES = {**DENSE_SHAPES, **MOE_SHAPES}
SHAPES = [*RANDOM_SHAPES, *DENSE_SHAPES, *MOE_SHAPES]


def write_built_tokenizer(shape, path):
    """A word-level tokenizer over the model's ids with its real special tokens at their real ids
    (the strings are arbitrary, the bench feeds random ids); pad is in the vocabulary and not the eos,
    so that Unsloth adds no token (which would resize the embeddings)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    spec = BUILT_SHAPES[shape]["tokenizer"]
    specials, named = spec["specials"], spec["named"]
    ordinary = {i: f"t{i}" for i in range(spec["size"]) if i not in specials}
    if spec.get("byte_alphabet"):
        ordinary.update(enumerate(byte_characters()))
    vocab = {token: i for i, token in ordinary.items()}
    vocab.update({token: i for i, token in sorted(specials.items())})
    unk = named.get("unk_token") or ordinary[min(ordinary)]
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=131072, **named)
    fast.add_special_tokens({"additional_special_tokens": [token for _, token in sorted(specials.items())
                                                           if token not in named.values()]})
    fast.save_pretrained(path)
    if len(fast) != spec["size"]:
        raise SystemExit(f"bench_unsloth: {shape}'s tokenizer has {len(fast)} ids, not {spec['size']}")
    return len(fast)


def write_built_checkpoint(shape, layers, path):
    """The random bf16 checkpoint of SHAPE's first LAYERS layers (transformers' init, built on the GPU,
    shards of 2 GB) and its tokenizer, into PATH.partial, then renamed to PATH. Runs in its own process
    (--write-checkpoint): Unsloth must not be imported here."""
    import torch
    import transformers
    spec = BUILT_SHAPES[shape]
    config_class, model_class = (getattr(transformers, name) for name in spec["classes"])
    if shape in DENSE_SHAPES:
        # As from_pretrained reads the published config.json (its legacy rope and sliding-window keys).
        config = config_class.from_dict(dict(spec["config"], num_hidden_layers=layers))
    else:
        extra = {}
        if shape == "gpt-oss-20b":
            extra["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        if shape == "qwen3-30b-a3b":
            extra["max_window_layers"] = layers
        config = config_class(num_hidden_layers=layers, **spec["config"], **extra)
    start = time.time()
    partial = path + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = model_class(config)
    model = model.to(torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise SystemExit(f"bench_unsloth: non-finite init in {bad[:4]}")
    model.config.dtype = "bfloat16"
    model.save_pretrained(partial, max_shard_size="2GB")
    del model
    tokens = write_built_tokenizer(shape, partial)
    os.replace(partial, path)
    print(f"bench_unsloth: wrote {path}: {shape}, {layers} layers, {count / 1e9:.2f} B weights, tokenizer of "
          f"{tokens} ids, in {time.time() - start:.0f} s", flush=True)


def built_checkpoint_path(shape, layers):
    # No model name in it: Unsloth special-cases names holding "gpt-oss-20b" or a hub repository's.
    return os.path.join(CHECKPOINT_DIR, f"ubench_{BUILT_SHAPES[shape]['tag']}_L{layers}")


def remove_other_checkpoints(keep):
    """Deletes the checkpoints this script writes, but KEEP: ubench_<tag>_L<N> in $QTRAIN_BENCH_CHECKPOINT_DIR
    and, where $QTRAIN_BENCH_CHECKPOINT is not set, the default llama3-8b ones (and unfinished .partial
    ones of each), so that the GPU machine's 64 GB disk holds one (an 8B bf16 checkpoint is about 16 GB,
    gemma3-12b's 24 GB). QTRAIN_BENCH_KEEP_CHECKPOINTS=1 keeps them all."""
    if os.environ.get("QTRAIN_BENCH_KEEP_CHECKPOINTS") == "1":
        return
    tags = "|".join(re.escape(spec["tag"]) for spec in BUILT_SHAPES.values())
    ours = [(CHECKPOINT_DIR, re.compile(rf"ubench_({tags})_L\d+(\.partial)?"))]
    if "QTRAIN_BENCH_CHECKPOINT" not in os.environ:
        ours.append((os.path.dirname(CHECKPOINT), re.compile(re.escape(os.path.basename(CHECKPOINT)) +
                                                             r"(-L\d+)?(\.partial)?")))
    ours.append((CHECKPOINT_DIR, re.compile(r"qtrain-bench-llama3-70b(-L\d+)?(\.partial)?")))
    for folder, name in ours:
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for entry in sorted(entries):
            path = os.path.join(folder, entry)
            if name.fullmatch(entry) and path not in (keep, keep + ".partial") and os.path.isdir(path) and \
                    not os.path.islink(path):
                print(f"bench_unsloth: deleting {path} (one random checkpoint on disk at a time)", flush=True)
                shutil.rmtree(path, ignore_errors=True)


def built_checkpoint(shape, layers):
    """SHAPE's checkpoint of LAYERS layers, written by a separate process where it is not on disk yet
    (the other checkpoints deleted first)."""
    path = built_checkpoint_path(shape, layers)
    if not os.path.isfile(os.path.join(path, "config.json")):
        remove_other_checkpoints(path)
        print(f"bench_unsloth: writing the random checkpoint into {path} (once)", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--shape", shape, "--layers", str(layers),
                        "--write-checkpoint"], check=True)
    return path


def pattern(name):
    """A parameter's name with its layer and expert indices as *."""
    return re.sub(r"\.\d+\.", ".*.", re.sub(r"\.\d+\.", ".*.", name))


def quantized_report(model):
    """What from_pretrained quantized: 4-bit parameters (the fused 3-D expert stacks included) and
    Linear4bit modules, and the big parameters it left alone, by name pattern."""
    quantized, unquantized = {}, {}
    for name, p in model.named_parameters():
        if type(p).__name__ == "Params4bit":
            shape = (getattr(p, "_original_shape", None) or getattr(getattr(p, "quant_state", None), "shape", None)
                     or p.shape)
            quantized.setdefault(pattern(name), [0, list(shape)])[0] += 1
        elif p.numel() >= 1 << 20:
            unquantized.setdefault(pattern(name), [0, list(p.shape), str(p.dtype)])[0] += 1
    linear4bit = sum(1 for m in model.modules() if type(m).__name__ == "Linear4bit")
    return dict(quantized_4bit=quantized, unquantized_big=unquantized, linear4bit_modules=linear4bit)


def lora_report(model):
    """What got LoRA: trainable tensors and LoRA wrappers by name pattern, peft's target_parameters."""
    trainable = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            entry = trainable.setdefault(pattern(name), [0, 0, list(p.shape)])
            entry[0] += 1
            entry[1] += p.numel()
    wrappers = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if hasattr(module, "lora_A") and kind != "ModuleDict":
            parameter = f"[{module.parameter_name}]" if hasattr(module, "parameter_name") else ""
            key = f"{kind}:{pattern(name)}{parameter}"
            wrappers[key] = wrappers.get(key, 0) + 1
    configs = getattr(model, "peft_config", {}).values()
    targets = sorted({t for c in configs for t in (getattr(c, "target_parameters", None) or [])})
    return dict(trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                trainable_tensors=sum(1 for p in model.parameters() if p.requires_grad),
                trainable_by_pattern=trainable, lora_wrappers=wrappers, peft_target_parameters=targets)


def write_tokenizer(path):
    """A word-level tokenizer over the 128,256 ids, Llama-3's specials at 128,000 on (as .gpu/make_tok.py):
    Unsloth's loader wants one; the strings are arbitrary, the bench feeds random ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"t{i}": i for i in range(128000)}
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(254)]
    vocab.update({token: 128000 + index for index, token in enumerate(specials)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
                            pad_token="<|reserved_special_token_2|>", model_max_length=8192).save_pretrained(path)


def write_checkpoint(path, *flags):
    """tools/random_checkpoint.py into PATH.partial (FLAGS passed on), its tokenizer replaced by one of the
    model's vocabulary and config.json given Llama-3's bos / eos ids; then renamed to PATH."""
    partial = path + ".partial"
    remove_other_checkpoints(path)
    print(f"bench_unsloth: writing the random checkpoint into {path} (once)", flush=True)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools/random_checkpoint.py"), partial, *flags], check=True)
    write_tokenizer(partial)
    with open(os.path.join(partial, "config.json")) as file:
        config = json.load(file)
    import transformers
    config.update(bos_token_id=128000, eos_token_id=128001, transformers_version=transformers.__version__)
    with open(os.path.join(partial, "config.json"), "w") as file:
        json.dump(config, file, indent=1)
    os.rename(partial, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama3-8b",
                        help=", ".join(SHAPES) + " (a random checkpoint of the shape on disk)")
    add_row_arguments(parser)
    parser.add_argument("--check", action="store_true",
                        help="only test that this can run: the shape, a GPU, `import unsloth` (exit 0 if so)")
    parser.add_argument("--write-checkpoint", action="store_true", help=argparse.SUPPRESS)  # the separate process
    args = parser.parse_args()
    result = dict(shape=args.shape, quant=args.quant, micro_batch=args.micro_batch, seq=args.seq,
                  checkpointing=args.checkpointing)

    def fail(message):
        print(f"bench_unsloth: {message}", file=sys.stderr)
        if args.json:
            print(json.dumps(dict(result, error=message)))
        return 1

    if args.shape not in SHAPES:
        return fail(f"--shape {args.shape}: only {', '.join(SHAPES)} are benchmarked here (Unsloth loads a random "
                    "checkpoint of the shape from disk)")
    moe = args.shape in MOE_SHAPES
    built = args.shape in BUILT_SHAPES  # written with transformers' init (else random_checkpoint.py's)
    full = (BUILT_SHAPES if built else RANDOM_SHAPES)[args.shape]["full_layers"]
    if args.shape == "llama3-70b" and args.quant != "qlora":
        return fail("--shape llama3-70b: its checkpoint is written already NF4 (bf16 would not fit the disk); "
                    "--quant qlora only")
    layers = args.layers or (MOE_DEFAULT_LAYERS if moe else full)
    if not 0 < layers <= full:
        return fail(f"--layers {args.layers}: {args.shape} has {full} layers")
    result["layers"] = layers
    if args.write_checkpoint:
        if not built:
            return fail(f"--write-checkpoint is for the shapes built with transformers' init, not {args.shape}")
        write_built_checkpoint(args.shape, layers, built_checkpoint_path(args.shape, layers))
        return 0
    import torch
    if not torch.cuda.is_available():
        return fail("no CUDA GPU: Unsloth's training step runs on an NVIDIA GPU")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    base = CHECKPOINT if args.shape == "llama3-8b" else os.path.join(CHECKPOINT_DIR, f"qtrain-bench-{args.shape}")
    path = base if layers == full else f"{base}-L{layers}"
    if built and not args.check:
        # Before `import unsloth`: the writing process starts with none of Unsloth's patches or settings.
        try:
            path = built_checkpoint(args.shape, layers)
        except subprocess.CalledProcessError as error:
            return fail(f"writing the random {args.shape} checkpoint failed (exit {error.returncode})")
    work = os.path.join(os.environ.get("TMPDIR", "/tmp"), "qtrain-bench-unsloth")
    os.makedirs(work, exist_ok=True)
    os.chdir(work)  # Unsloth writes its compiled cache (unsloth_compiled_cache/) into the working directory
    try:
        import unsloth  # before transformers and peft, as Unsloth asks
        from unsloth import FastLanguageModel
    except Exception as error:  # noqa: BLE001 (Unsloth raises several kinds where it cannot run)
        hint = "; tools/bench.sh puts $QTRAIN_UNSLOTH_PATH on PYTHONPATH" if isinstance(error, ImportError) else ""
        return fail(f"unsloth does not import ({type(error).__name__}: {error}){hint}")
    if args.check:
        if built:
            import transformers
            missing = [name for name in BUILT_SHAPES[args.shape]["classes"] if not hasattr(transformers, name)]
            if missing:
                return fail(f"transformers {transformers.__version__} has no {', '.join(missing)}")
        return 0

    import peft
    import transformers
    versions = f"unsloth {unsloth.__version__}, transformers {transformers.__version__}, peft {peft.__version__}"
    if args.quant == "qlora":
        import bitsandbytes
        versions += f", bitsandbytes {bitsandbytes.__version__}"
    if not built and not os.path.isfile(os.path.join(path, "config.json")):
        write_checkpoint(path, "--device", "cuda", *RANDOM_SHAPES[args.shape]["flags"],
                         *([] if layers == full else ["--layers", str(layers)]))
    checkpointing = "unsloth" if args.checkpointing else False
    targets = BUILT_SHAPES.get(args.shape, {}).get("targets", PROJECTIONS)
    torch.manual_seed(0)
    seconds, step, report = [], None, {}
    try:
        start = time.time()
        model, _ = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=args.seq,
                                                     dtype=torch.bfloat16, load_in_4bit=args.quant == "qlora",
                                                     use_gradient_checkpointing=checkpointing)
        if moe:
            report.update(quantized_report(model))
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0.0, bias="none",
                                                 target_modules=targets, random_state=0,
                                                 use_gradient_checkpointing=checkpointing)
        FastLanguageModel.for_training(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
        print(f"bench_unsloth: model loaded in {time.time() - start:.1f} s", flush=True)
        if moe:
            report.update(lora_report(model))
            print(f"bench_unsloth: {report['trainable_params']:,} trainable weights; 4-bit "
                  f"{json.dumps(report['quantized_4bit'])}, {report['linear4bit_modules']} Linear4bit; LoRA wrappers "
                  f"{json.dumps(report['lora_wrappers'])}", flush=True)
        elif built:  # only said, not in the JSON: what got LoRA (Phi-3's fused names)
            lora = lora_report(model)
            print(f"bench_unsloth: {lora['trainable_params']:,} trainable weights; LoRA wrappers "
                  f"{json.dumps(lora['lora_wrappers'])}", flush=True)

        vocab = model.config.vocab_size if hasattr(model.config, "vocab_size") else \
            BUILT_SHAPES[args.shape]["config"]["vocab_size"]
        input_ids = torch.randint(vocab, (args.micro_batch, args.seq), device="cuda")
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            began = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if step >= args.warmup:
                seconds.append(time.perf_counter() - began)
        if moe:
            try:
                from unsloth_zoo.temporary_patches import moe_utils
                report["moe_backend"] = moe_utils.select_moe_backend()
            except Exception as error:  # noqa: BLE001 (only a note)
                report["moe_backend"] = f"? {type(error).__name__}"
    except torch.cuda.OutOfMemoryError as error:
        where = "while loading" if step is None else f"at step {step}"
        print(f"bench_unsloth: out of memory {where} ({versions})", file=sys.stderr)
        if args.json:
            print(json.dumps(dict(result, oom=f"{where}: " + str(error).split("\n")[0][:200], versions=versions,
                                  **report)))
        return 0
    except Exception as error:  # noqa: BLE001 (the table gets a row either way)
        traceback.print_exc()
        return fail(f"Unsloth failed ({type(error).__name__}: {error})")
    median = statistics.median(seconds)
    tokens_per_second = args.micro_batch * args.seq / median
    peak = torch.cuda.max_memory_allocated()
    depth = "" if layers == full else f" (first {layers} of {full} layers)"
    print(f"bench_unsloth: {args.shape}{depth} {args.quant}, micro-batch {args.micro_batch} x {args.seq}, "
          f"checkpointing {'unsloth' if args.checkpointing else 'off'} ({versions})")
    print(f"  {tokens_per_second:.0f} tokens/s (median of {args.steps} steps, {median:.3f} s each), "
          f"peak memory {peak / 2**30:.2f} GiB")
    if args.json:
        print(json.dumps(dict(result, tokens_per_second=tokens_per_second, peak_memory_bytes=peak,
                              step_seconds=median, versions=versions, **report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
