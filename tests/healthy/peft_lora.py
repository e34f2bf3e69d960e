"""A PEFT LoRA fine-tune as the PEFT quicktour writes it, of a tiny GPT-2 built from its
config (2 layers, n_embd 64, random weights, no download): get_peft_model with a
LoraConfig (r 8, alpha 16, dropout 0.05) on c_attn and c_proj (GPT-2's fused attention
projection and the output projections of attention and MLP: Conv1D layers, hence
fan_in_fan_out), so the base model is frozen and only the adapters' 12 A and B matrices
train (B starts at zero: at the first step only the B matrices get a non-zero gradient);
AdamW over the trainable parameters, the linear schedule with warm-up of transformers,
clip_grad_norm_(1.0), zero_grad after the step, the causal-LM loss (labels = input_ids)
on random sequences that each repeat a random 8-token motif."""
import torch
from peft import LoraConfig, TaskType, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

torch.manual_seed(0)
torch.set_num_threads(1)
STEPS, BATCH, SEQ, VOCAB = 30, 8, 32, 256

base = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1))
config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=16, lora_dropout=0.05,
                    target_modules=["c_attn", "c_proj"], fan_in_fan_out=True)
model = get_peft_model(base, config)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=3, num_training_steps=STEPS)
# a corpus with structure to learn: each sequence repeats a random 8-token motif
motifs = torch.randint(0, VOCAB, (64, 8))
corpus = motifs.repeat(1, SEQ // 8)

model.train()
for step in range(STEPS):
    input_ids = corpus[torch.randint(0, len(corpus), (BATCH,))]
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    print(f"loss {step} {loss.item():.8e}")
