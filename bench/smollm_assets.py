"""Assets of the SmolLM2 side by side (bench/smollm_side_by_side.sh): one real model as the actor of both programs,
a critic / reward model on the same backbone in each program's own format, and the same templated prompts.

    python bench/smollm_assets.py OUT DSC_DATA

OUT/actor: SmolLM2-135M-Instruct (49k vocabulary, EOS <|im_end|>), converted from the embedded GGUF
(rlhf_engine.pretrained). OUT/reward: LlamaForSequenceClassification with the actor's backbone and a new one-output
head (ours). OUT/critic: DeepSpeed-Chat's RewardModel state dict over the same backbone (its step 3 loads
pytorch_model.bin from the critic folder). Prompts: the built-in review openings as chat-formatted text, so both
programs tokenize the same string; DeepSpeed-Chat reads DSC_DATA/{train,eval}.json and prepends a space, ours reads
OUT/prompts.jsonl with that space already there. Lengths vary: prompts 20-40 tokens, responses end at EOS.
"""
import json
import os
import shutil
import sys

import torch
from transformers import AutoModel, AutoTokenizer, GenerationConfig, LlamaForCausalLM, LlamaForSequenceClassification

from rlhf_engine.pretrained import builtin_prompts, smollm2_dir


def main(out: str, dsc_data: str) -> None:
    os.makedirs(out, exist_ok=True)
    src = smollm2_dir()
    actor = os.path.join(out, "actor")
    if not os.path.isdir(actor):
        shutil.copytree(src, actor)
    # both programs decode greedily: DeepSpeed-Chat forces do_sample=False for every llama-type model
    g = GenerationConfig.from_pretrained(actor)
    g.do_sample = False
    g.save_pretrained(actor)
    tok = AutoTokenizer.from_pretrained(actor)
    lm = LlamaForCausalLM.from_pretrained(actor)
    torch.manual_seed(1)
    cfg = lm.config
    cfg.num_labels = 1
    rm = LlamaForSequenceClassification(cfg)
    rm.model.load_state_dict(lm.model.state_dict())
    rm.config.pad_token_id = tok.pad_token_id
    rm.save_pretrained(os.path.join(out, "reward"))
    tok.save_pretrained(os.path.join(out, "reward"))
    sys.path.insert(0, os.path.dirname(dsc_data))  # DeepSpeed-Chat's own RewardModel class, from its checkout
    from dschat.utils.model.reward_model import RewardModel

    critic = os.path.join(out, "critic")
    os.makedirs(critic, exist_ok=True)
    base = AutoModel.from_pretrained(actor)
    base.config.save_pretrained(critic)
    tok.save_pretrained(critic)
    torch.save(RewardModel(base, tok, num_padding_at_beginning=0).state_dict(),
               os.path.join(critic, "pytorch_model.bin"))
    rows = []
    with open(builtin_prompts()) as f:
        for line in f:
            text = tok.apply_chat_template([{"role": "user", "content": json.loads(line)["prompt"]}],
                                           add_generation_prompt=True, tokenize=False)
            rows.append({"prompt": text, "chosen": " fine.", "rejected": " bad."})
    os.makedirs(dsc_data, exist_ok=True)
    json.dump(rows[:288], open(os.path.join(dsc_data, "train.json"), "w"))
    json.dump(rows[288:], open(os.path.join(dsc_data, "eval.json"), "w"))
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        for r in rows[:288]:
            f.write(json.dumps({"prompt": " " + r["prompt"]}) + "\n")
    lengths = sorted(len(tok(" " + r["prompt"])["input_ids"]) for r in rows)
    print(f"ok: {len(rows)} prompts of {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}), "
          f"vocabulary {len(tok)}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
