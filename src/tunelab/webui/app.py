"""`tunelab webui`: the HTTP routes of the web UI, and the server that runs them.

One page (templates/index.html, static/webui.js, static/webui.css) with four screens — Configure, Data, Runs,
Try — over a JSON API. Every route is a thin call into forms.py (config <-> form, the CLI's checks),
tryout.py (data preview, chat, eval, export) or runs.py (training processes and their files); errors the user
can fix come back as {"error": one line, "key": the field} with 400, refusals (a live run, a stopped job)
with 409. Training never runs in this process; chat loads the model here (one at a time).
"""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path
from typing import Any

import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from tunelab.errors import ConfigError, TunelabError
from tunelab.webui import forms, tryout
from tunelab.run_folder import read_log
from tunelab.webui.runs import Refused, RunManager, error_line, tail
from tunelab.webui.security import Access, Roots, check_listen, is_loopback

HERE = Path(__file__).resolve().parent
TOKEN_COOKIE = "tunelab_webui_token"


def _host_name(host: str) -> str:
    """The name of a Host header, without its port ("[::1]:7860" -> "::1")."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _error(exc: TunelabError, options: dict[str, Any] | None = None) -> JSONResponse:
    message = str(exc)
    key = forms.key_of_message(message, options or {}) if options is not None else None
    return JSONResponse({"error": message, "key": key}, status_code=409 if isinstance(exc, Refused) else 400)


def create_app(roots: Roots, access: Access | None = None, python: str | None = None) -> FastAPI:
    """The app. Without credentials, only requests addressed to a loopback name are answered: a web page
    elsewhere cannot reach the UI by pointing its own domain at 127.0.0.1 (DNS rebinding)."""
    access = access or Access()
    runs = RunManager(roots, python)
    config_lock = threading.Lock()  # one config built at a time: TrainingArguments sets process-wide state
    engines = tryout.EngineCache()
    pages = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
    app = FastAPI(title="tunelab webui", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runs = runs

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if not access.required and not is_loopback(_host_name(request.headers.get("host", ""))):
            return Response("tunelab webui: open it as http://127.0.0.1:PORT/ or http://localhost:PORT/\n",
                            status_code=403)
        query_token = request.query_params.get("token")
        if not access.allows(request.headers.get("authorization"), request.cookies.get(TOKEN_COOKIE), query_token):
            headers = {"WWW-Authenticate": 'Basic realm="tunelab webui"'} if access.user_password else {}
            return Response("tunelab webui: credentials required\n", status_code=401, headers=headers)
        response = await call_next(request)
        if access.token and query_token:  # the token once in the URL; the cookie from then on
            response.set_cookie(TOKEN_COOKIE, access.token, httponly=True, samesite="strict")
        return response

    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.get("/", response_class=HTMLResponse)
    def index() -> str:
        fields = forms.form_fields()
        return pages.get_template("index.html").render(
            fields=fields, sections=forms.SECTIONS, roots=[str(r) for r in roots.folders], other=forms.OTHER)

    @app.post("/api/check")
    def check(form: dict[str, Any]) -> JSONResponse:
        try:
            options = forms.options_from_form(form)
        except TunelabError as exc:
            return JSONResponse({"ok": False, "message": str(exc), "key": forms.OTHER, "yaml": ""})
        with config_lock:
            _, result = forms.check_options(options, roots)
        return JSONResponse(result.as_dict() | {"yaml": forms.options_yaml(options)})

    @app.post("/api/yaml")
    def load_yaml(body: dict[str, Any]) -> JSONResponse:
        try:
            return JSONResponse({"form": forms.form_from_yaml(str(body.get("text", "")))})
        except TunelabError as exc:
            return _error(exc)

    @app.get("/api/datasets")
    def datasets(dataset_dir: str = "") -> JSONResponse:
        """The names the dataset fields offer: the built-in datasets and those of dataset_dir/dataset_info.json."""
        # lazy: the web UI starts without huggingface_hub (registry -> hub.py) and the data and training stacks
        from tunelab.data.registry import load_registry

        try:
            folder = str(roots.resolve(dataset_dir, "dataset_dir")) if dataset_dir.strip() else None
            return JSONResponse({"names": list(load_registry(folder))})
        except TunelabError as exc:
            return _error(exc)

    @app.post("/api/preview")
    def preview(form: dict[str, Any]) -> JSONResponse:
        options: dict[str, Any] = {}
        try:
            options = forms.options_from_form(form)
            roots.check_options(options)
            # lazy: the web UI starts without torch, datasets and transformers (torch alone 2.8 s)
            from tunelab.preflight import load_config

            with config_lock:
                config = load_config(None, dict(options), purpose="data", warn=False)
            return JSONResponse(tryout.preview(config))
        except TunelabError as exc:
            return _error(exc, options)

    @app.post("/api/launch")
    def launch(form: dict[str, Any]) -> JSONResponse:
        options: dict[str, Any] = {}
        try:
            options = forms.options_from_form(form)
            out = options.get("output_dir")
            if out:  # a live run there is refused before the checks (which would call the folder not empty)
                runs.refuse_if_live(roots.resolve(out, "output_dir"))
            with config_lock:
                _, result = forms.check_options(options, roots)
            if not result.ok:
                return JSONResponse({"error": result.message, "key": result.key}, status_code=400)
            started = runs.launch(forms.options_yaml(options), str(options["output_dir"]))
        except TunelabError as exc:
            return _error(exc, options)
        return JSONResponse({"dir": str(started.output_dir), "pid": started.pid})

    @app.get("/api/runs")
    def list_runs() -> JSONResponse:
        found = [runs.status(folder) for folder in runs.run_dirs()]
        return JSONResponse({"runs": found})

    @app.get("/api/run")
    def run(dir: str, since: int = 0) -> JSONResponse:
        try:
            folder = roots.resolve(dir, "dir")
        except TunelabError as exc:
            return _error(exc)
        info = runs.status(folder)
        info["log"] = read_log(folder)[since:]
        info["console"] = runs.console_of(folder)
        return JSONResponse(info)

    @app.post("/api/stop")
    def stop(body: dict[str, Any]) -> JSONResponse:
        try:
            launch = runs.stop(str(body.get("dir", "")))
        except TunelabError as exc:
            return _error(exc)
        return JSONResponse({"dir": str(launch.output_dir), "signal": "SIGTERM"})

    @app.post("/api/resume")
    def resume(body: dict[str, Any]) -> JSONResponse:
        try:
            launch = runs.resume(str(body.get("dir", "")))
        except TunelabError as exc:
            return _error(exc)
        return JSONResponse({"dir": str(launch.output_dir), "pid": launch.pid})

    @app.post("/api/chat")
    def chat(body: dict[str, Any]) -> Response:
        try:
            folder = roots.resolve(str(body.get("dir", "")), "dir")
            engine = engines.get(folder)
            stream = tryout.chat_stream(engine, list(body.get("messages") or []),
                                        float(body.get("temperature", 0.0)), int(body.get("max_new_tokens", 64)))
            first = next(stream, "")  # errors in the prompt surface here, as JSON, not mid-stream
        except TunelabError as exc:
            return _error(exc)

        def pieces():
            yield first
            yield from stream

        return StreamingResponse(pieces(), media_type="text/plain; charset=utf-8")

    def _job(kind: str, body: dict[str, Any]) -> JSONResponse:
        try:
            folder = roots.resolve(str(body.get("dir", "")), "dir")
            if kind == "eval":
                args, out = tryout.eval_args(folder, int(body.get("max_samples", 20)), str(body.get("eval_dataset") or ""))
            else:
                args, out = tryout.export_args(folder)
                roots.resolve(out, "export_dir")
            job = runs.job(kind, out, args)
        except TunelabError as exc:
            return _error(exc)
        return JSONResponse({"job": job.folder.name, "out": str(out)})

    @app.post("/api/eval")
    def evaluate(body: dict[str, Any]) -> JSONResponse:
        return _job("eval", body)

    @app.post("/api/export")
    def export(body: dict[str, Any]) -> JSONResponse:
        return _job("export", body)

    @app.get("/api/job")
    def job(id: str) -> JSONResponse:
        try:
            launch = runs.find_job(id)
        except TunelabError as exc:
            return _error(exc)
        state = "running" if launch.alive else ("finished" if launch.exit_code == 0 else "failed")
        if state == "failed" and launch.exit_code is None:
            state = "ended"  # it ended while no UI process was watching it: the exit code is unknown
        console = launch.console.read_text(encoding="utf-8", errors="replace") if launch.console.is_file() else ""
        info: dict[str, Any] = {"kind": launch.kind, "state": state, "out": str(launch.output_dir),
                                "console": tail(launch.console, 15),
                                "error": error_line(console) if state == "failed" else None}
        if launch.kind == "eval" and state == "finished":
            info.update(tryout.predictions(launch.output_dir))
        return JSONResponse(info)

    return app


def serve(host: str, port: int, roots: Roots, access: Access) -> None:
    """Bind, print the URL, serve until Ctrl-C."""
    check_listen(host, access)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); choose another "
                          "port, or --port 0 for any free one") from None
    sock.listen(128)  # connections wait from now on: the URL printed below answers as soon as it is read
    app = create_app(roots, access)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}/"
    print(f"tunelab webui: {url}  (allowed roots: {', '.join(map(str, roots.folders))}; Ctrl-C stops the UI, "
          "not the runs)", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    sys.stdout.flush()
