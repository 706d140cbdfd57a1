"""Exports a trained model to the formats other runtimes read, and checks every export by reading it back.

    merge.py        export_model(config) -> Exported: `tunelab export`. The model as trained (base + adapter, in
                    float32), the merge checked on the probes, then export_format hf (a plain Hugging Face folder,
                    export_dtype / torchao export_quantization) or gguf (gguf_writer + modelfile), then the read-back
                    check (parity) → export_report.json; check_export_dir: the preflight checks of an export
    gguf_writer.py  write_gguf(model, tokenizer, chat_template, template_vars, out_path, tensor_type) -> Path:
                    a merged Hugging Face causal LM + tokenizer + the run's chat template → one .gguf file
                    (llama.cpp, Ollama, LM Studio), with the source's provenance (source_provenance) in general.*;
                    ExportError for what cannot be written
    kquants.py      quantize(values, ttype): Q4_K / Q5_K / Q6_K blocks in ggml's layout (gguf-py only reads them)
    modelfile.py    write_modelfile(gguf_path, tokenizer, chat_template, template_vars) -> Path: the Ollama
                    Modelfile beside it
    parity.py       check_parity(reference_model, tokenizer, chat_template, template_vars, exported, kind,
                    report_path=...) -> ParityReport: the written model (kind "hf": a folder, "gguf": a file)
                    reloaded through independent readers (transformers; llama.cpp's server via xllamacpp) and
                    compared with the model as trained (token ids, chat template, logits, greedy answers, held-out
                    exact match) → export_report.json; ParityError when it differs

gguf_writer.py, kquants.py and modelfile.py import gguf (the `gguf` extra): merge.py imports them only for a GGUF
export, and parity.py only to check a GGUF file, so a folder export and its check work without the extra.
"""
