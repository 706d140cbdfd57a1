"""Exports a trained model to the formats other runtimes read, and checks every export by reading it back.

    gguf_writer.py  write_gguf(model, tokenizer, chat_template, template_vars, out_path, tensor_type) -> Path:
                    a merged Hugging Face causal LM + tokenizer + the run's chat template → one .gguf file
                    (llama.cpp, Ollama, LM Studio); ExportError for what cannot be written
    modelfile.py    write_modelfile(gguf_path, tokenizer, chat_template, template_vars) -> Path: the Ollama
                    Modelfile beside it
    parity.py       check_parity(reference_model, tokenizer, chat_template, template_vars, exported, kind,
                    report_path=...) -> ParityReport: the written model (kind "hf": a folder, "gguf": a file)
                    reloaded through an independent reader and compared with the model as trained (token ids,
                    chat template, logits, greedy answers) → export_report.json; ParityError when it differs

Merging a LoRA adapter and the plain Hugging Face folder stay in model/export.py; this package starts from the
merged float32 model it produces. The modules import gguf (the `gguf` extra): import them where an export needs
them, not at start-up.
"""
