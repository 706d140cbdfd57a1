"""Exports a trained model to the formats other runtimes read, and checks every export by reading it back.

    gguf_writer.py  a merged Hugging Face causal LM + tokenizer + chat template → one .gguf file (llama.cpp,
                    Ollama, LM Studio)
    modelfile.py    the Ollama Modelfile beside it
    parity.py       the written model reloaded through an independent reader and compared with the model as
                    trained: token ids, chat template, logits, greedy answers → export_report.json

Merging a LoRA adapter and the plain Hugging Face folder stay in model/export.py; this package starts from the
merged model it produces.
"""
