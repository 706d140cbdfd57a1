"""Paths to test data shared beside the checkout (../shared/fixtures), as CI lays it out too."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"
CHAT_TEMPLATE_FIXTURES = SHARED_FIXTURES / "chat_templates"
