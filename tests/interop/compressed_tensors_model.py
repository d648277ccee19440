"""compressed-tensors checkpoints as llm-compressor writes them and transformers runs them (CPU, fp32).

    python compressed_tensors_model.py quantize SRC_DIR SCHEME OUT_DIR [--dtype float32|bfloat16]
    python compressed_tensors_model.py quantize-many SRC_DIR OUT_PREFIX SCHEME [SCHEME ...] [--dtype ...]
    python compressed_tensors_model.py logits MODEL_DIR INPUTS.safetensors INPUT_KEY OUT.safetensors [--adapter DIR]
    python compressed_tensors_model.py logits-many INPUTS.safetensors INPUT_KEY MODEL_DIR OUT.safetensors [MODEL_DIR OUT ...]
    python compressed_tensors_model.py decompress MODEL_DIR OUT.safetensors [MODEL_DIR OUT ...]

quantize: the round-to-nearest PTQ of llm-compressor's
    oneshot(model, recipe=QuantizationModifier(scheme=SCHEME, targets="Linear", ignore=["lm_head"]))
    followed by model.save_pretrained(OUT_DIR), made with the compressed-tensors package alone (no
    llm-compressor): SRC_DIR is loaded in --dtype (default float32), the preset SCHEME (W4A16,
    W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC, NVFP4A16, ...) goes on every nn.Linear but lm_head, each
    weight gets the qparams of llm-compressor's default weight observer ("memoryless_minmax": min and
    max over each group / channel / the tensor, then compressed_tensors' calculate_qparams; for NVFP4
    the tensor-wide global scale of generate_gparam, shared by q/k/v and by gate/up as llm-compressor's
    fuse_weight_observers shares it), then ModelCompressor compresses and writes config.json's
    quantization_config exactly as llm-compressor's save_pretrained wrapper does. A Linear whose
    in_features is not a multiple of the group size is left unquantized (one stderr line each): it
    lands in `ignore`. (llm-compressor itself errors for in_features >= group_size and crashes in its
    observer for in_features < group_size; the user has to list such layers in `ignore`.)
    With --dtype bfloat16 the scales are bf16 and compressed-tensors' CPU path divides weight / scale
    in bf16 before rounding; its CUDA (Triton) kernel, which llm-compressor uses on a GPU, divides in
    fp32, so a few codes (~0.6% for W4A16 on tiny-llama) differ from a GPU run. fp32 has no such gap.
logits: loads MODEL_DIR with AutoModelForCausalLM.from_pretrained(dtype=torch.float32) as a user
    would, runs the decompression transformers would run on the first forward (see load_decompressed;
    W8A8 / FP8_DYNAMIC keep quantizing input activations per token in every forward), optionally puts
    PeftModel.from_pretrained(ADAPTER_DIR) on top (exits 1 if peft did not place every adapter
    tensor), runs the int64 [batch, seq] tensor INPUT_KEY of INPUTS and writes `logits` (fp32).
quantize-many: `quantize` of each SCHEME into OUT_PREFIX + SCHEME in one process (torch starts once).
logits-many: `logits` for each MODEL_DIR OUT pair in one process (torch starts once).
decompress: for every quantized module of that model, `<module>.weight` (the dense weight
    compressed-tensors' decompressor made) and `<module>.weight_scale`, both fp32; the metadata maps
    `<module>.weight` to the dtype the decompressor produced it in (bfloat16 for NVFP4).
A config that soft-caps attention (Gemma 2) runs eager attention, the only one that caps.
"""
import argparse
import json
import os
import shutil
import sys
from collections import defaultdict

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.offload import update_offload_parameter
from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, QuantizationStrategy,
                                             apply_quantization_config, preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "added_tokens.json")
# llm-compressor's FUSED_LAYER_NAMES: sibling layers whose NVFP4 (tensor_group) weights share one global scale.
FUSED_LAYER_NAMES = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"), ("q_a_proj", "kv_a_proj_with_mqa"),
                     ("w1", "w3"))


def attention_for(model_dir):
    """Eager attention where the config soft-caps the scores (SDPA would not cap them)."""
    with open(f"{model_dir}/config.json") as f:
        capped = json.load(f).get("attn_logit_softcapping") is not None
    return {"attn_implementation": "eager"} if capped else {}


def observe_min_max(weight, args):
    """llm-compressor's flatten_for_calibration(weight) then MemorylessMinMaxObserver's amin/amax over (0, -1)."""
    if args.strategy == QuantizationStrategy.TENSOR:
        flat = weight.reshape(1, 1, -1)                                  # -> min/max [1]
    elif args.strategy == QuantizationStrategy.CHANNEL:
        flat = weight.unsqueeze(-2).unsqueeze(0)                         # -> [out, 1]
    elif args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP):
        flat = weight.unflatten(-1, (-1, args.group_size)).unsqueeze(0)  # -> [out, in / group]
    else:
        raise ValueError(f"weight strategy {args.strategy} is not round-to-nearest min-max here")
    return torch.amin(flat, dim=(0, -1)), torch.amax(flat, dim=(0, -1))


def global_scales(model, stats):
    """Observer.get_global_scale: generate_gparam of the absmax over the module and its fused siblings."""
    groups = {name: [name] for name in stats}
    for parent_name, parent in model.named_modules():
        for names in FUSED_LAYER_NAMES:
            if not all(hasattr(parent, n) for n in names):
                continue
            full = [f"{parent_name}.{n}" if parent_name else n for n in names]
            present = [n for n in full if n in stats]
            if present and len(present) != len(full):  # llm-compressor asserts all fused layers share the scheme
                raise ValueError(f"fused layers {full}: only {present} are quantized")
            for n in present:
                groups[n] = present
    result = {}
    for name, members in groups.items():
        absmax = stats[members[0]][1].max()
        for m in members:
            absmax = torch.max(absmax, -stats[m][0].min())
            absmax = torch.max(absmax, stats[m][1].max())
        result[name] = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
    return result


def quantize(src, scheme_name, out, dtype):
    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype), **attention_for(src))
    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    group = scheme.weights.group_size if scheme.weights.strategy in ("group", "tensor_group") else None
    ignore = ["lm_head"]
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and group and module.in_features % group:
            print(f"ignoring {name}: in_features {module.in_features} is not a multiple of group size {group}",
                  file=sys.stderr)
            ignore.append(name)
    # QuantizationMixin.resolve_quantization_config + initialize_quantization
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore,
                                quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    quantized = {n: m for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}

    # QuantizationModifier.on_sequential_epoch_end: observe(modules, "weight"); update_qparams(modules, "weight")
    with torch.no_grad():
        stats = {n: observe_min_max(m.weight, m.quantization_scheme.weights) for n, m in quantized.items()}
        gscales = (global_scales(model, stats) if scheme.weights.strategy == QuantizationStrategy.TENSOR_GROUP
                   else defaultdict(lambda: None))
        for name, module in quantized.items():
            scale, zero_point = calculate_qparams(*stats[name], module.quantization_scheme.weights,
                                                  global_scale=gscales[name])
            for suffix, value in (("scale", scale), ("zero_point", zero_point), ("global_scale", gscales[name])):
                if value is not None and hasattr(module, f"weight_{suffix}"):
                    update_offload_parameter(module, f"weight_{suffix}", value)  # copy_ into the param's dtype
            module.quantization_status = QuantizationStatus.FROZEN  # freeze_module_quantization

    # llm-compressor's save_pretrained wrapper (modify_save_pretrained)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=None)
    compressor.compress_model(model, skip_compressed=True)
    model.save_pretrained(out, max_shard_size="20GB")
    compressor.update_config(out)
    with open(os.path.join(out, "recipe.yaml"), "w") as f:  # what oneshot records (informational only)
        f.write("default_stage:\n  default_modifiers:\n    QuantizationModifier:\n"
                f"      targets: [Linear]\n      ignore: [lm_head]\n      scheme: {scheme_name.upper()}\n")
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
    return 0


def load_decompressed(model_dir):
    """from_pretrained(dtype=fp32) as a user calls it, then the decompression its first forward would run.

    transformers 5.17 leaves a compressed-tensors checkpoint compressed (CompressedTensorsConfig's
    dequantize=False) and registers a forward pre-hook that runs compressor.decompress_model(model) on
    the first forward; this runs it up front, which is what dequantize=True (the old
    run_compressed=False) does at load time. It has to happen before peft wraps the layers: peft
    needs `base_layer.weight`, which packed formats only have once decompressed. The modules stay
    torch.nn.Linear with the scheme attached: compressed-tensors' wrapped forward keeps quantizing the
    input activations of W8A8 / FP8_DYNAMIC per token on every call. NVFP4's decompressor returns
    bf16 weights (unpack_fp4_from_uint8's default dtype), which F.linear refuses next to fp32
    activations, so those weights are cast to fp32 afterwards (exact: a bf16 value is an fp32 value).
    """
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **attention_for(model_dir))
    if getattr(model, "ct_decompress_hook", None) is not None:
        model.hf_quantizer.compressor.decompress_model(model)  # also removes the hook
    dtypes = {}
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is not None:
            dtypes[name] = module.weight.dtype
            module.weight.data = module.weight.data.float()  # (transformers refuses model.float() here)
    return model, dtypes


def logits(model_dir, inputs_path, input_key, out_path, adapter_dir):
    model, _ = load_decompressed(model_dir)
    if adapter_dir:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
        saved = load_file(f"{adapter_dir}/adapter_model.safetensors")
        placed = {n.replace(".default.", "."): t for n, t in model.named_parameters() if ".lora_" in n}
        if set(saved) != set(placed) or any(not torch.equal(placed[n].detach().to(t.dtype), t)
                                            for n, t in saved.items()):
            print("adapter tensors peft did not place:", sorted(set(saved) ^ set(placed))[:5], file=sys.stderr)
            return 1
    model.eval()
    input_ids = load_file(inputs_path)[input_key]
    with torch.no_grad():
        result = model(input_ids=input_ids).logits.float().contiguous()
    save_file({"logits": result}, out_path)
    return 0


def decompress(model_dir, out_path):
    """The dense weights transformers runs: compressed-tensors' decompress_model on the fp32-loaded model."""
    model, dtypes = load_decompressed(model_dir)
    out = {}
    for name, dtype in dtypes.items():
        module = model.get_submodule(name)
        out[f"{name}.weight"] = module.weight.detach().float().contiguous()
        out[f"{name}.weight_scale"] = module.weight_scale.detach().float().contiguous()
    # the dtype the decompressor produced each weight in (bfloat16 for NVFP4, else float32)
    save_file(out, out_path, metadata={f"{name}.weight": str(dtype) for name, dtype in dtypes.items()})
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    q = sub.add_parser("quantize")
    q.add_argument("src"), q.add_argument("scheme"), q.add_argument("out")
    q.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    lg = sub.add_parser("logits")
    for arg in ("model_dir", "inputs", "input_key", "out"):
        lg.add_argument(arg)
    lg.add_argument("--adapter")
    qm = sub.add_parser("quantize-many")
    qm.add_argument("src"), qm.add_argument("prefix"), qm.add_argument("schemes", nargs="+")
    qm.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    many = sub.add_parser("logits-many")
    many.add_argument("inputs"), many.add_argument("input_key"), many.add_argument("pairs", nargs="+")
    d = sub.add_parser("decompress")
    d.add_argument("pairs", nargs="+")
    a = parser.parse_args()
    if a.mode == "quantize":
        return quantize(a.src, a.scheme, a.out, a.dtype)
    if a.mode == "logits":
        return logits(a.model_dir, a.inputs, a.input_key, a.out, a.adapter)
    if a.mode == "quantize-many":
        return max(quantize(a.src, scheme, a.prefix + scheme, a.dtype) for scheme in a.schemes)
    if a.mode == "logits-many":
        if len(a.pairs) % 2:
            parser.error("logits-many takes MODEL_DIR OUT pairs")
        return max(logits(model_dir, a.inputs, a.input_key, out, None)
                   for model_dir, out in zip(a.pairs[::2], a.pairs[1::2]))
    if len(a.pairs) % 2:
        parser.error("decompress takes MODEL_DIR OUT pairs")
    return max(decompress(model_dir, out) for model_dir, out in zip(a.pairs[::2], a.pairs[1::2]))


if __name__ == "__main__":
    sys.exit(main())
