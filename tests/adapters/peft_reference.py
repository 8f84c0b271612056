"""Run in the converter venv (torch, transformers, peft; never in llamax's
own): PEFT LoRA adapters for a GGUF llama model, each trained a few steps,
saved as PEFT saves them, with the logits PyTorch computes for given tokens.

    python peft_reference.py MODEL.gguf OUT_DIR '[token, ...]'

transformers loads the GGUF itself (dequantized, query/key rows put back in
Hugging Face's order), so the PEFT model is the llama.cpp model plus the
adapter.  Variants:
- plain: r=4, alpha=8 on all seven linear modules, adapter_model.safetensors;
- patterns: rsLoRA, rank_pattern and alpha_pattern, adapter_model.bin
  (torch's zip pickle).
Writes OUT_DIR/{base_logits.npy, VARIANT/(adapter files, logits.npy)}.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

VARIANTS = {
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"]),
    "patterns": dict(r=4, lora_alpha=6, use_rslora=True, rank_pattern={"q_proj": 2}, alpha_pattern={"v_proj": 3},
                     target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]),
}


def main():
    gguf_path, out, tokens = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    ids = torch.tensor([tokens])
    for name, kw in VARIANTS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     torch_dtype=torch.float32)
        if name == "plain":
            with torch.no_grad():
                np.save(out / "base_logits.npy", model(ids).logits[0].numpy())
        pm = get_peft_model(model, LoraConfig(init_lora_weights=False, **kw))
        opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.05)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):  # a few steps: the saved weights are trained ones, not the initial draw
            batch = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)
            pm(batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
        pm.eval()
        d = out / name
        pm.save_pretrained(str(d), safe_serialization=(name == "plain"))
        with torch.no_grad():
            np.save(d / "logits.npy", pm(ids).logits[0].numpy())


if __name__ == "__main__":
    main()
