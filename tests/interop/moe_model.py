"""Tiny random Qwen3-MoE / Mixtral / gpt-oss checkpoints and transformers' fp32 CPU reference outputs.

    python moe_model.py make FAMILY OUT_DIR
    python moe_model.py make-fused FAMILY OUT_DIR
    python moe_model.py make-legacy FAMILY OUT_DIR
    python moe_model.py make-mxfp4 gpt_oss OUT_DIR
    python moe_model.py logits MODEL_DIR IDS_JSON OUT.safetensors
    python moe_model.py weights MODEL_DIR OUT.safetensors
    python moe_model.py lora MODEL_DIR OUT_ADAPTER_DIR
    python moe_model.py logits-lora MODEL_DIR ADAPTER_DIR IDS_JSON OUT.safetensors
    python moe_model.py fixture FAMILY OUT_DIR IDS_JSON

FAMILY (fp32, hidden 64, head_dim 16, 4 heads / 2 kv heads, vocab 320 (MOE_VOCAB=N in the environment: N),
every weight, norm, bias and sink random;
the same FAMILY always gives the same weights, whatever the make mode):
    qwen3_moe        4 layers, 8 experts top-2, moe_intermediate 24, norm_topk_prob, mlp_only_layers [2]
                     (layer 2 is a dense SwiGLU MLP of intermediate 96), q/k norms.
    qwen3_moe_step2  4 layers, decoder_sparse_step 2 (MoE on layers 1 and 3, dense on 0 and 2),
                     norm_topk_prob false (routing weights are the un-renormalised softmax top-2).
    qwen3_moe_all    3 layers, all of them experts (8, top-2, renormalised): what llama.cpp's qwen3moe holds.
    mixtral          3 layers, 4 experts top-2, intermediate 40, sliding_window 8 on every layer.
    gpt_oss          4 layers (sliding 8 / full alternating, layer_types), 6 experts top-3,
                     intermediate 96, q/k/v/o biases, sinks, router bias, expert biases, yarn rope as
                     gpt-oss ships it (theta 150000, factor 32, original 4096, beta 32 / 1, truncate
                     false); gate_up_proj drawn wide (std 0.5) so the SwiGLU clamps at +-7 do bite.

make: model.save_pretrained(OUT_DIR) as transformers 5.17 writes it: for qwen3_moe / mixtral it
    reverts the fused in-memory experts to the per-expert hub layout
    (`mlp.experts.N.{gate,up,down}_proj.weight`, Mixtral `block_sparse_moe.experts.N.w{1,2,3}.weight`
    and `block_sparse_moe.gate.weight`); gpt-oss stays fused (`mlp.experts.gate_up_proj` [E, H, 2I],
    gate/up interleaved, `..._bias`, `down_proj` [E, I, H]).
make-fused: save_pretrained(save_original_format=False): the in-memory layout (`mlp.experts.gate_up_proj`
    [E, 2I, H] = gate rows then up rows, `mlp.experts.down_proj` [E, H, I], Mixtral `mlp.gate.weight`),
    which transformers also loads. Same as `make` for gpt_oss.
make-legacy: `make`'s tensors with config.json as transformers 4.x / the hub write it: `rope_theta` and
    `rope_scaling` instead of `rope_parameters`, `torch_dtype`, Qwen3-MoE's `num_experts` (5.17 writes
    `num_local_experts`), gpt-oss's `experts_per_token`, `swiglu_limit`, `initial_context_length`.
make-mxfp4 (gpt_oss only): the experts as gpt-oss ships them, MXFP4: `gate_up_proj_blocks` uint8
    [E, 2I, H/32, 16], `gate_up_proj_scales` uint8 [E, 2I, H/32], `down_proj_blocks` [E, H, I/32, 16],
    `down_proj_scales` [E, H, I/32] (biases stay float), config.json hub-style with
    quantization_config {"quant_method": "mxfp4", ...}. The blocks are a round-to-nearest quantization
    of `make`'s weights (so the logits differ from `make`'s); transformers on a CPU without the
    `kernels` package dequantizes them on load (integrations/mxfp4.py), which `weights` shows.
logits: AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=float32, attn_implementation="eager",
    experts_implementation="eager") and one forward with labels and output_router_logits=True.
    IDS_JSON is a path or an inline JSON text: [[ids], ...], [ids] (batch 1), or
    {"input_ids": [[...]], "attention_mask": [[...]]} (labels are the ids, -100 where the mask is 0;
    the mask also goes to the forward and thus to the aux loss). Writes fp32 `logits` [B, T, V],
    `loss` (transformers' out.loss = lm loss + router_aux_loss_coef * aux_loss), `aux_loss`
    (out.aux_loss, load_balancing_loss_func), `lm_loss` (model.loss_function alone), `token_loss`
    [B, T-1] (cross entropy of position t predicting t+1, 0 where ignored), `router_logits`
    [n_moe_layers, B*T, E] (out.router_logits, router weight (+bias) only), `moe_layers` int64
    (which decoder layers they come from), `router_topk_margin` (smallest gap between the k-th and
    k+1-th router logit over all tokens: a tiny one would make top-k fragile), `input_ids`, `labels`,
    `attention_mask`; metadata: router_aux_loss_coef, num_experts_per_tok.
weights: every parameter as transformers holds it after loading MODEL_DIR in fp32 (fused 3D experts,
    dequantized MXFP4), under its in-memory name.
lora: a peft LoRA (r 4, alpha 8, no dropout) on q/k/v/o_proj plus
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    (peft's ParamWrapper on the fused 3D expert tensors), every lora_A / lora_B random (seed 1),
    saved with save_pretrained. Also writes OUT_ADAPTER_DIR/reference_deltas.safetensors: for each
    wrapped expert tensor `<module>.<param>` the delta peft adds to it (scaling * B_e @ A_e per expert,
    in the parameter's in-memory layout). peft names the two wrappers it nests on one experts module by
    parameter registration order: `...mlp.experts.base_layer.lora_{A,B}.weight` is gate_up_proj,
    `...mlp.experts.lora_{A,B}.weight` is down_proj; lora_A.weight is [r*E, in] (expert-major rows),
    lora_B.weight [out, r*E] (column k*E + e is rank k of expert e).
logits-lora: `logits` with PeftModel.from_pretrained(ADAPTER_DIR) on top; exits 1 when peft and the
    adapter file disagree on which LoRA tensors exist or what they hold.
fixture: all of it in one process (each call spends ~9 s importing transformers): OUT_DIR/model (make),
    OUT_DIR/fused, OUT_DIR/legacy, for gpt_oss OUT_DIR/mxfp4, each with reference.safetensors (`logits`
    of IDS_JSON) and weights.safetensors (`weights`), and OUT_DIR/adapter (`lora` on OUT_DIR/model) with
    reference.safetensors (`logits-lora`).
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from script_modes import run_mode
from transformers import (AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

COMMON = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)

# name: (config class, model class, overrides)
FAMILIES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=24, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[2], decoder_sparse_step=1,
                       router_aux_loss_coef=0.02)),
    "qwen3_moe_step2": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                        dict(num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=24, num_experts=8,
                             num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2,
                             router_aux_loss_coef=0.02)),
    "qwen3_moe_all": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                      dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=24, num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
                           router_aux_loss_coef=0.02)),
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                dict(num_hidden_layers=3, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=8, router_aux_loss_coef=0.02)),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM,
                dict(num_hidden_layers=4, intermediate_size=96, num_local_experts=6, num_experts_per_tok=3,
                     sliding_window=8, attention_bias=True, max_position_embeddings=131072, rms_norm_eps=1e-5,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                     rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                      "original_max_position_embeddings": 4096},
                     router_aux_loss_coef=0.02)),
}

# One thread: the eager experts' index_add_ on these tiny tensors costs ~50 ms a call with OpenMP on a busy
# 2-core box and ~10 us without.
torch.set_num_threads(1)

TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# integrations/mxfp4.py FP4_VALUES: code c (0..15) -> value; bit 3 is the sign.
FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def build(family):
    """The FAMILY model, fp32, every tensor random (seed 0): the same weights on every call."""
    if family not in FAMILIES:
        raise SystemExit(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    config_class, model_class, overrides = FAMILIES[family]
    torch.manual_seed(0)
    # MOE_VOCAB: a larger vocabulary, for a tokenizer of that size (training through qtrain's CLI).
    vocab = dict(vocab_size=int(os.environ["MOE_VOCAB"])) if os.environ.get("MOE_VOCAB") else {}
    model = model_class(config_class(**{**COMMON, **overrides, **vocab})).to(torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.1)               # RMSNorm weights (ones by default), q/k norms too
            elif name.endswith("sinks"):
                parameter.normal_(0.0, 1.0)               # gpt-oss attention sinks (std 0.02 by default)
            elif "bias" in name:
                parameter.normal_(0.0, 0.1)               # attention / router / expert biases (experts' are 0)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                parameter.normal_(0.0, 0.2)               # decisive routing: no near-ties in top-k
            elif name.endswith("experts.gate_up_proj") and family == "gpt_oss":
                parameter.normal_(0.0, 0.5)               # gate / up past the +-7 clamps
            else:
                parameter.normal_(0.0, 0.05)
    return model


def write_config(path, edit):
    with open(path) as f:
        config = json.load(f)
    edit(config)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def to_legacy_config(config):
    """config.json keys as transformers 4.x and the hub checkpoints have them."""
    parameters = dict(config.pop("rope_parameters"))
    config["rope_theta"] = parameters.pop("rope_theta")
    if parameters.get("rope_type", "default") != "default":
        config["rope_scaling"] = parameters               # e.g. gpt-oss: {"rope_type": "yarn", "factor": 32.0, ...}
    config["torch_dtype"] = config.pop("dtype")
    if config["model_type"] == "qwen3_moe":
        config["num_experts"] = config.pop("num_local_experts")
    if config["model_type"] == "gpt_oss":
        config["experts_per_token"] = config["num_experts_per_tok"]
        config["swiglu_limit"] = 7.0
        config["initial_context_length"] = parameters["original_max_position_embeddings"]


def make(family, out_dir):
    build(family).save_pretrained(out_dir)
    return 0


def make_fused(family, out_dir):
    build(family).save_pretrained(out_dir, save_original_format=False)
    return 0


def make_legacy(family, out_dir):
    build(family).save_pretrained(out_dir)
    write_config(os.path.join(out_dir, "config.json"), to_legacy_config)
    return 0


def quantize_mxfp4(weight):
    """[..., rows, in] fp32 -> (blocks uint8 [..., rows, in/32, 16], scales uint8 [..., rows, in/32]).

    Round to nearest of FP4_VALUES * 2^e, e per 32 consecutive inputs the smallest with max|w| / 2^e <= 6;
    scales holds e + 127, blocks two codes a byte, the even element in the low nibble (what
    _convert_moe_packed_tensors undoes).
    """
    *prefix, inputs = weight.shape
    assert inputs % 32 == 0, f"MXFP4 groups 32 inputs; {inputs} is not a multiple"
    groups = weight.reshape(*prefix, inputs // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = torch.where((scaled < 0) & (codes > 0), codes + 8, codes).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent.to(torch.int32) + 127).to(torch.uint8).contiguous()


def make_mxfp4(family, out_dir):
    if family != "gpt_oss":
        raise SystemExit("make-mxfp4 is for gpt_oss only (the only family that ships MXFP4 experts)")
    model = build(family)
    model.save_pretrained(out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # in memory [E, in, out]; on disk the rows are the outputs, as in a Linear weight
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, path, metadata={"format": "pt"})

    def hub_style(config):
        to_legacy_config(config)
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    write_config(os.path.join(out_dir, "config.json"), hub_style)
    return 0


def load(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
    return model.float().eval() if getattr(model, "hf_quantizer", None) is None else model.eval()


def read_ids(spec):
    text = open(spec).read() if os.path.exists(spec) else spec
    data = json.loads(text)
    if isinstance(data, dict):
        input_ids = torch.tensor(data["input_ids"], dtype=torch.int64)
        mask = data.get("attention_mask")
        mask = None if mask is None else torch.tensor(mask, dtype=torch.int64)
    else:
        input_ids, mask = torch.tensor(data, dtype=torch.int64), None
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        mask = None if mask is None else mask.reshape(1, -1)
    labels = input_ids.clone() if mask is None else input_ids.masked_fill(mask == 0, -100)
    return input_ids, mask, labels


def moe_layers(model):
    """Indices of the decoder layers with a router (out.router_logits has one entry for each, in order)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [i for i, layer in enumerate(base.model.layers) if hasattr(layer.mlp, "experts")]


def reference(model, ids_spec, out_path):
    input_ids, mask, labels = read_ids(ids_spec)
    config = model.config
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, labels=labels, output_router_logits=True)
        logits = out.logits.float()
        lm_loss = model.loss_function(logits, labels, config.vocab_size)
        token_loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                     ignore_index=-100, reduction="none").reshape(labels.shape[0], -1)
    router_logits = torch.stack([r.float() for r in out.router_logits])
    k = config.num_experts_per_tok
    top = router_logits.topk(k + 1, dim=-1).values if k < router_logits.shape[-1] else None
    margin = (top[..., k - 1] - top[..., k]).min() if top is not None else torch.tensor(float("inf"))
    if margin < 1e-4:
        print(f"warning: router top-{k} margin {margin.item():.3g}: routing may flip under rounding", file=sys.stderr)
    result = {
        "logits": logits.contiguous(), "loss": out.loss.float().reshape(()), "aux_loss": out.aux_loss.float().reshape(()),
        "lm_loss": lm_loss.float().reshape(()), "token_loss": token_loss.contiguous(),
        "router_logits": router_logits.contiguous(), "moe_layers": torch.tensor(moe_layers(model), dtype=torch.int64),
        "router_topk_margin": margin.float().reshape(()), "input_ids": input_ids, "labels": labels,
        "attention_mask": torch.ones_like(input_ids) if mask is None else mask,
    }
    save_file(result, out_path, metadata={"router_aux_loss_coef": repr(config.router_aux_loss_coef),
                                          "num_experts_per_tok": str(k)})
    return 0


def logits(model_dir, ids_spec, out_path):
    return reference(load(model_dir), ids_spec, out_path)


def weights(model_dir, out_path):
    model = load(model_dir)
    save_file({name: tensor.detach().float().contiguous() for name, tensor in model.state_dict().items()}, out_path)
    return 0


def lora(model_dir, adapter_dir):
    from peft import LoraConfig, get_peft_model
    model = load(model_dir)
    # No gate_proj / up_proj / down_proj in target_modules: peft 0.21 (utils/transformers_weight_conversion.py
    # _convert_peft_config_moe) rewrites those names, for qwen2_moe-style models (qwen3_moe) and mixtral (w1/w2/w3),
    # into target_parameters gate_up_proj / down_proj with rank_pattern / alpha_pattern x2 on gate_up_proj, which
    # also leaves a Qwen3-MoE dense layer's (mlp_only_layers) nn.Linear projections without LoRA.
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=TARGET_PARAMETERS, init_lora_weights=False)
    model = get_peft_model(model, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                parameter.normal_(0.0, 0.1)
    model.save_pretrained(adapter_dir)
    deltas = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper":
            owner = name
            while owner.endswith(".base_layer"):
                owner = owner[: -len(".base_layer")]
            owner = owner.removeprefix("base_model.model.")
            with torch.no_grad():
                deltas[f"{owner}.{module.parameter_name}"] = module.get_delta_weight("default").float().contiguous()
    save_file(deltas, os.path.join(adapter_dir, "reference_deltas.safetensors"))
    return 0


def logits_lora(model_dir, adapter_dir, ids_spec, out_path):
    from peft import PeftModel
    model = PeftModel.from_pretrained(load(model_dir), adapter_dir).eval()
    saved = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    placed = {n.replace(".default.", "."): t for n, t in model.named_parameters() if ".lora_" in n}
    if set(saved) != set(placed) or any(not torch.equal(placed[n].detach().to(t.dtype), t) for n, t in saved.items()):
        print("adapter tensors peft did not place:", sorted(set(saved) ^ set(placed))[:5], file=sys.stderr)
        return 1
    return reference(model, ids_spec, out_path)


def fixture(family, out_dir, ids_spec):
    """Everything above for one FAMILY in one process (transformers' import is most of a call's time)."""
    variants = [("model", make), ("fused", make_fused), ("legacy", make_legacy)]
    if family == "gpt_oss":
        variants.append(("mxfp4", make_mxfp4))
    for name, maker in variants:
        directory = os.path.join(out_dir, name)
        maker(family, directory)
        model = load(directory)
        reference(model, ids_spec, os.path.join(directory, "reference.safetensors"))
        save_file({n: t.detach().float().contiguous() for n, t in model.state_dict().items()},
                  os.path.join(directory, "weights.safetensors"))
    adapter = os.path.join(out_dir, "adapter")
    lora(os.path.join(out_dir, "model"), adapter)
    return logits_lora(os.path.join(out_dir, "model"), adapter, ids_spec, os.path.join(adapter, "reference.safetensors"))


if __name__ == "__main__":
    sys.exit(run_mode({"make": make, "make-fused": make_fused, "make-legacy": make_legacy, "make-mxfp4": make_mxfp4,
                       "logits": logits, "weights": weights, "lora": lora, "logits-lora": logits_lora,
                       "fixture": fixture}))
