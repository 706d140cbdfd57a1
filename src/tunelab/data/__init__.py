"""Data pipeline: registry → formats → templates → encode → collate."""
