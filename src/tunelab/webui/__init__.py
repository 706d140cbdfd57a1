"""The web UI (`tunelab webui`): configure, launch, watch and try fine-tuning runs from a browser (docs/webui.md)."""
