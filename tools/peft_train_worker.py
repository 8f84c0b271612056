"""Run by tools/train_adapters.py in the converter venv (torch, transformers,
peft; never llamax's own): trains one PEFT LoRA adapter on SmolLM2 from
token-id examples and saves it.

    python peft_train_worker.py MODEL.gguf EXAMPLES.jsonl OUT_DIR --steps N --seed S

EXAMPLES.jsonl: {"input_ids": [...], "n_prompt": k} per line; the loss is
on the tokens after the first k (the answer and its end token).
"""
import argparse
import json
import random
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("examples")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    gguf = Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    pm = get_peft_model(model, cfg)
    examples = [json.loads(line) for line in open(args.examples)]
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    pm.train()
    t0 = time.time()
    order = []
    for step in range(args.steps):
        if len(order) < args.batch:
            order += rng.sample(range(len(examples)), len(examples))
        batch = [examples[order.pop()] for _ in range(args.batch)]
        width = max(len(e["input_ids"]) for e in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, e in enumerate(batch):
            t = torch.tensor(e["input_ids"])
            ids[i, :len(t)] = t
            mask[i, :len(t)] = 1
            labels[i, e["n_prompt"]:len(t)] = t[e["n_prompt"]:]
        loss = pm(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f} s)", flush=True)
    pm.save_pretrained(args.out)


if __name__ == "__main__":
    main()
