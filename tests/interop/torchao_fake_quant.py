"""What torchao's QAT fake quantizers make of a tensor, for tests/trainer/torchao_reference_test.cpp.

    python torchao_fake_quant.py SCHEME IN.safetensors OUT.safetensors
        IN holds cases CASE.x (fp32 or bf16, as the fake quantizer takes it) and CASE.upstream (x's
        shape and dtype: the gradient of the loss with respect to the fake-quantized tensor). For
        each, a fresh fake quantizer of SCHEME writes CASE.values (the fake-quantized x, x's
        dtype), CASE.grad (torchao's autograd gradient of sum(values * upstream) with respect to
        x, x's dtype) and, where the fake quantizer keeps them, CASE.scale and CASE.zero_point
        (fp32, torchao's shapes). One process for many cases: importing torchao takes seconds.

SCHEME, each torchao's own configuration (torchao 0.18):
    8da4w-weight-G        Int8DynActInt4WeightQATQuantizer(groupsize=G)'s weight quantizer
    8da4w-activation      Int8DynActInt4WeightQATQuantizer's activation quantizer (per token)
    int4-weight-only-G    QATConfig(Int4WeightOnlyConfig(group_size=G))'s weight quantizer
    gguf-q4_0, gguf-q8_0  IntxFakeQuantizeConfig(torch.int4 / torch.int8, group_size=32,
                          scale_precision=torch.float16): the GGUF grids in torchao's terms
Exits 2 on an unknown scheme.
"""
import sys
import warnings

import torch
from safetensors.torch import load_file, save_file
from torchao.quantization import Int4WeightOnlyConfig, quantize_
from torchao.quantization.qat import (
    Int8DynActInt4WeightQATQuantizer,
    IntxFakeQuantizeConfig,
    QATConfig,
)
from torchao.quantization.qat.fake_quantizer import FakeQuantizerBase


def int4_weight_only_quantizer(group_size: int, shape) -> torch.nn.Module:
    # The fake quantizer QATConfig's prepare step puts on a linear layer of the weight's shape.
    linear = torch.nn.Sequential(torch.nn.Linear(shape[1], shape[0], bias=False))
    quantize_(linear, QATConfig(Int4WeightOnlyConfig(group_size=group_size), step="prepare"))
    return linear[0].weight_fake_quantizer


def quantizer_factory(scheme: str):
    """A function of the input's shape that makes a fresh fake quantizer of SCHEME; None if unknown."""
    if scheme.startswith("8da4w-weight-"):
        group_size = int(scheme.rsplit("-", 1)[1])
        config = Int8DynActInt4WeightQATQuantizer(groupsize=group_size).get_weight_fake_quantize_config()
        return lambda shape: FakeQuantizerBase.from_config(config)
    if scheme == "8da4w-activation":
        config = Int8DynActInt4WeightQATQuantizer().get_activation_fake_quantize_config()
        return lambda shape: FakeQuantizerBase.from_config(config)
    if scheme.startswith("int4-weight-only-"):
        group_size = int(scheme.rsplit("-", 1)[1])
        return lambda shape: int4_weight_only_quantizer(group_size, shape)
    if scheme in ("gguf-q4_0", "gguf-q8_0"):
        dtype = torch.int4 if scheme == "gguf-q4_0" else torch.int8
        config = IntxFakeQuantizeConfig(dtype, group_size=32, is_symmetric=True, scale_precision=torch.float16)
        return lambda shape: FakeQuantizerBase.from_config(config)
    return None


def main() -> int:
    scheme, in_path, out_path = sys.argv[1:4]
    make_quantizer = quantizer_factory(scheme)
    if make_quantizer is None:
        print(f"unknown scheme {scheme!r}", file=sys.stderr)
        return 2
    inputs = load_file(in_path)
    outputs = {}
    for case in sorted(name[: -len(".x")] for name in inputs if name.endswith(".x")):
        x = inputs[case + ".x"].clone().requires_grad_(True)
        quantizer = make_quantizer(x.shape)
        values = quantizer(x)
        values.backward(inputs[case + ".upstream"].to(values.dtype))
        outputs[case + ".values"] = values.detach().contiguous()
        outputs[case + ".grad"] = x.grad.contiguous()
        for name in ("scale", "zero_point"):
            tensor = getattr(quantizer, name, None)
            if tensor is not None:
                outputs[case + "." + name] = tensor.detach().to(torch.float32).contiguous()
    save_file(outputs, out_path)
    return 0


if __name__ == "__main__":
    # The 8da4w quantizer's configuration still names its int4 dtype TorchAODType.INT4, which
    # torchao 0.18 reports as deprecated on every use.
    warnings.simplefilter("ignore", UserWarning)
    sys.exit(main())
