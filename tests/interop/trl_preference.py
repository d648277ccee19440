"""One batch of preference pairs through TRL 1.16's own trainers: the loss, its metrics and the
gradient of every LoRA weight, for qtrain's preference objectives to equal.

    python trl_preference.py BASE_DIR ADAPTER_DIR OUT_DIR NAME:CASE:PAIRS.jsonl [...]

Each CASE names a trainer and its settings (CASES below), run on the pairs of PAIRS.jsonl. The trainer is built as a user builds
it: the model from BASE_DIR in fp32 on the CPU, `peft_config` for a LoRA on the 7 projections,
the pairs as a datasets.Dataset; the adapter's weights are then set to ADAPTER_DIR's
(a non-zero B, so that policy and reference differ). The first batch of the trainer's own data
loader (every pair, in order) goes through `trainer.compute_loss` and `backward`. Writes
OUT_DIR/NAME.safetensors (`loss`, `input_ids`: the batch's chosen rows then its rejected rows,
right-padded, and `grad.<peft name without base_model.model. and .default>`) and
OUT_DIR/NAME.json (TRL's logged metrics). Used by tests/trainer/preference_test.cpp.
"""
import json
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig, set_peft_model_state_dict  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.utils import logging  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOConfig, ORPOTrainer  # noqa: E402

logging.set_verbosity_error()

# case -> (trainer, config class, settings)
CASES = {
    "dpo_sigmoid": (DPOTrainer, DPOConfig, {"loss_type": ["sigmoid"], "beta": 0.1}),
    "dpo_ipo": (DPOTrainer, DPOConfig, {"loss_type": ["ipo"], "beta": 0.1}),
    "dpo_hinge": (DPOTrainer, DPOConfig, {"loss_type": ["hinge"], "beta": 0.3}),
    "dpo_robust": (DPOTrainer, DPOConfig, {"loss_type": ["robust"], "beta": 0.1, "label_smoothing": 0.1}),
    "orpo": (ORPOTrainer, ORPOConfig, {"beta": 0.2}),
    "simpo": (CPOTrainer, CPOConfig, {"loss_type": "simpo", "beta": 0.1, "simpo_gamma": 0.5, "cpo_alpha": 1.0}),
    "simpo_pure": (CPOTrainer, CPOConfig,
                   {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 1.0, "cpo_alpha": 0.0, "label_smoothing": 0.1}),
}


def chosen_then_rejected(batch, pad_id):
    """The batch's sequences as one [2 * pairs, longest] tensor, right-padded."""
    if "input_ids" in batch:  # DPOTrainer's collator: already chosen rows, then rejected rows
        return batch["input_ids"]
    rows = [batch["chosen_input_ids"], batch["rejected_input_ids"]]
    longest = max(row.shape[1] for row in rows)
    return torch.cat([torch.nn.functional.pad(row, (0, longest - row.shape[1]), value=pad_id) for row in rows])


def main() -> int:
    base_dir, adapter_dir, out_dir = sys.argv[1:4]
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    adapter = load_file(f"{adapter_dir}/adapter_model.safetensors")
    with open(f"{adapter_dir}/adapter_config.json") as f:
        adapter_config = json.load(f)
    for item in sys.argv[4:]:
        name, case, pairs_path = item.split(":", 2)
        with open(pairs_path) as f:
            pairs = [json.loads(line) for line in f if line.strip()]
        trainer_class, config_class, settings = CASES[case]
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        args = config_class(output_dir=os.path.join(out_dir, "trainer"), report_to="none", use_cpu=True, bf16=False,
                            fp16=False, gradient_checkpointing=False, per_device_train_batch_size=len(pairs),
                            train_sampling_strategy="sequential", dataloader_num_workers=0, disable_tqdm=True,
                            max_length=1024, **settings)
        peft_config = LoraConfig(r=adapter_config["r"], lora_alpha=adapter_config["lora_alpha"], lora_dropout=0.0,
                                 target_modules=adapter_config["target_modules"], task_type="CAUSAL_LM")
        trainer = trainer_class(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                                processing_class=tokenizer, peft_config=peft_config)
        result = set_peft_model_state_dict(trainer.model, adapter)
        if result.unexpected_keys or [key for key in result.missing_keys if "lora_" in key]:
            print("the adapter did not fit the trainer's model:", result)
            return 1
        trainer.model.train()
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        tensors = {"loss": loss.detach().reshape(1),
                   "input_ids": chosen_then_rejected(batch, tokenizer.pad_token_id).contiguous()}
        for parameter_name, parameter in trainer.model.named_parameters():
            if parameter.requires_grad:
                short = parameter_name.replace("base_model.model.", "", 1).replace(".default", "")
                tensors["grad." + short] = parameter.grad.detach().contiguous()
        save_file(tensors, os.path.join(out_dir, f"{name}.safetensors"))
        logged = trainer._metrics["train"] if hasattr(trainer, "_metrics") else trainer._stored_metrics["train"]
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            json.dump({metric: values[-1] for metric, values in logged.items()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
