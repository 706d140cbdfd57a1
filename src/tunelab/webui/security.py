"""What the web UI lets a browser reach: the allowed roots for paths, and who may connect.

Allowed roots: the folder `tunelab webui` starts in, plus each `--root`. Every path a form or request names
(model, dataset, output and export folders, a run to watch, chat with, evaluate or export) is resolved —
symlinks and `..` included — and refused unless it lies inside one of them. The embedded tiny model
(`tiny`) and Hub ids that name no local folder are not paths and pass.

Who may connect: the UI listens on 127.0.0.1 unless told otherwise; any other address needs `--auth
user:password` (HTTP Basic) or `--token TOKEN` (`Authorization: Bearer TOKEN`, or `?token=` once, which sets a
cookie), checked on every request.
"""

from __future__ import annotations

import base64
import ipaddress
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunelab.assets import EMBEDDED_MODELS
from tunelab.errors import ConfigError

# Keys whose values are local paths that a run reads or writes.
PATH_KEYS = ("model_name_or_path", "adapter_name_or_path", "dataset_dir", "output_dir", "export_dir",
             "resume_from_checkpoint", "reward_model", "deepspeed", "tokenized_path", "cache_dir",
             "teacher_model_name_or_path")
# The keys that name a model: an embedded model's name or a Hub id is not a path of this machine.
MODEL_KEYS = ("model_name_or_path", "teacher_model_name_or_path")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Roots:
    folders: tuple[Path, ...]
    base: Path  # relative paths resolve against it (the runs start in it too)

    @classmethod
    def of(cls, base: str | Path, extra: list[str] | None = None) -> "Roots":
        base = Path(base).resolve()
        folders = [base, *(Path(r).expanduser().resolve() for r in extra or [])]
        missing = [str(f) for f in folders if not f.is_dir()]
        if missing:
            raise ConfigError(f"--root: {', '.join(missing)} is not a folder")
        return cls(tuple(dict.fromkeys(folders)), base)

    def resolve(self, value: str | Path, key: str = "path") -> Path:
        """The path, resolved; ConfigError naming the key when it lies outside every allowed root."""
        path = Path(str(value)).expanduser()
        path = (path if path.is_absolute() else self.base / path).resolve()
        if not any(path == root or path.is_relative_to(root) for root in self.folders):
            allowed = ", ".join(str(r) for r in self.folders)
            raise ConfigError(f"{key}: {value} is outside the folders this UI may use ({allowed}); "
                              "start tunelab webui with --root FOLDER to allow another")
        return path

    def check_options(self, options: dict[str, Any]) -> None:
        for key in PATH_KEYS:
            value = options.get(key)
            if value is None or str(value).strip() == "" or isinstance(value, bool):
                continue
            text = str(value).strip()
            if key in MODEL_KEYS and text in EMBEDDED_MODELS:
                continue
            if key == "resume_from_checkpoint" and text.lower() in ("true", "false", "1", "0", "yes", "no"):
                continue
            if key in (*MODEL_KEYS, "adapter_name_or_path", "reward_model") and _HUB_ID.match(text) \
                    and not (self.base / text).exists() and not Path(text).is_absolute():
                continue  # a Hub id: read through the Hugging Face cache, not a path of this machine
            self.resolve(text, key)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Access:
    """Credentials a request must carry; both None: anyone who can reach the (loopback) address."""

    user_password: str | None = None  # "user:password", HTTP Basic
    token: str | None = None

    @property
    def required(self) -> bool:
        return bool(self.user_password or self.token)

    def allows(self, authorization: str | None, cookie_token: str | None, query_token: str | None) -> bool:
        if not self.required:
            return True
        if self.token:
            for given in (cookie_token, query_token):
                if given and secrets.compare_digest(given, self.token):
                    return True
            if authorization and authorization.startswith("Bearer ") and secrets.compare_digest(
                    authorization[7:].strip(), self.token):
                return True
        if self.user_password and authorization and authorization.startswith("Basic "):
            try:
                given = base64.b64decode(authorization[6:].strip()).decode("utf-8")
            except (ValueError, UnicodeDecodeError):
                return False
            return secrets.compare_digest(given, self.user_password)
        return False


def check_listen(host: str, access: Access) -> None:
    """Refuse a non-loopback address without credentials (one line, the CLI prints it)."""
    if access.user_password is not None and ":" not in access.user_password:
        raise ConfigError("--auth: expected user:password")
    if not is_loopback(host) and not access.required:
        raise ConfigError(f"--host {host}: the web UI starts and stops training runs and reads files, so any address "
                          "other than loopback needs --auth user:password or --token TOKEN")
