"""An example training callback: every `every` steps, answer a few fixed questions greedily and score them.

    callbacks: examples/callbacks/sample_generations.py:SampleGenerations
    callback_kwargs:
      SampleGenerations: {template: chatml, every: 50, questions: ["Sort the numbers from smallest to largest.\\n3 1 2"], references: ["1 2 3"]}

Each time, one line per question goes to output_dir/sample_generations.jsonl: step, question, answer, reference
and the answer's ROUGE-L against it (0-100). Only the main process writes. A callback is a plain
transformers.TrainerCallback: the Trainer hands it the model and tokenizer with every event.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from tunelab.data.templates import get_template
from tunelab.infer.metrics import rouge_l_score


class SampleGenerations(transformers.TrainerCallback):
    def __init__(self, template: str, questions: list[str], references: list[str], every: int = 50,
                 max_new_tokens: int = 32):
        if len(questions) != len(references):
            raise ValueError(f"{len(questions)} questions but {len(references)} references")
        self.template_name, self.questions, self.references = template, questions, references
        self.every, self.max_new_tokens = every, max_new_tokens

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.every or not state.is_world_process_zero:
            return
        tokenizer = processing_class
        template = get_template(self.template_name, tokenizer)
        stops = [tokenizer.convert_tokens_to_ids(word) for word in template.stop_words] + [tokenizer.eos_token_id]
        was_training = model.training
        model.eval()
        answers = []
        with torch.no_grad():
            for question in self.questions:  # one at a time: no padding to think about
                prompt = template.prompt([{"role": "user", "content": question}])
                ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(model.device)
                out = model.generate(input_ids=ids, max_new_tokens=self.max_new_tokens, do_sample=False,
                                     eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
                answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
        if was_training:
            model.train()
        with (Path(args.output_dir) / "sample_generations.jsonl").open("a", encoding="utf-8") as handle:
            for question, answer, reference in zip(self.questions, answers, self.references):
                record = {"step": state.global_step, "question": question, "answer": answer, "reference": reference,
                          "rouge_l": rouge_l_score([answer], [reference])}
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
