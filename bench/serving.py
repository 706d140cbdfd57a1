"""Throughput of `tunelab api` with N parallel clients, batched (--max-batch-size B) against one request at a time.

Starts `tunelab api MODEL --port 0` on 127.0.0.1 twice, in subprocesses, with --max-batch-size 1 and with
B, and for each client count N runs N threads that each send R greedy chat completions one after another
(the official `openai` client, no streaming, max_tokens T, a different question per request), on each
server in turn, --repeats times. Printed per server and N (the median run): generated tokens per second
over the run (usage.completion_tokens summed / wall time), and the mean and 95th-percentile latency of
one request. Loopback only; bounded by N·R requests per run and --deadline seconds overall.

MODEL defaults to a randomly initialised Llama of ~20M parameters on the embedded tokenizer (built once
under bench/.data/, chatml template): big enough that a forward pass costs more than Python's overhead,
small enough for a CPU. Its answers are noise; only their length and timing matter here (a random model
rarely emits <|im_end|>, so most answers run to T tokens). Any trained folder works too (--model PATH).

Before timing, it also checks that greedy answers are the same batched as alone, in process: the
questions are sent to one engine at once (one batch, left-padded) and one by one, and the token ids
compared.

    python bench/serving.py                                # N = 1, 4, 8; R = 4; T = 64; B = 8; 3 repeats
    python bench/serving.py --clients 1,8 --requests 2 --max-tokens 32 --repeats 1 --model saves/quickstart
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
DATA_DIR = BENCH_DIR / ".data"
SRC_DIR = BENCH_DIR.parent / "src"


def random_model(folder: Path) -> Path:
    """A randomly initialised Llama (hidden 512, 8 layers) with the tiny tokenizer and the chatml template."""
    if (folder / "config.json").is_file():
        return folder
    import torch  # noqa: PLC0415
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    from tunelab.assets import TINY_MODEL_DIR  # noqa: PLC0415
    from tunelab.data.templates import get_template  # noqa: PLC0415
    from tunelab.infer.generate import stop_token_ids  # noqa: PLC0415

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_MODEL_DIR)
    config.update({"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
                   "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 2048})
    model = AutoModelForCausalLM.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    template = get_template("chatml", tokenizer)
    tokenizer.chat_template = template.jinja
    model.generation_config.eos_token_id = stop_token_ids(tokenizer, template)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"built {folder} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)", file=sys.stderr)
    return folder


def question(client: int, request: int) -> list[dict]:
    return [{"role": "user", "content": f"Client {client}, question {request}: " + "tell me more. " * (1 + client % 3)}]


def check_batched_equals_alone(model: str, questions: int, max_tokens: int) -> tuple[int, int]:
    """(questions whose greedy answer is the same batched as alone, questions), in this process."""
    from tunelab.infer.engine import SamplingOptions, load_engine  # noqa: PLC0415

    engine = load_engine(model)
    engine.max_batch_size = questions
    options = SamplingOptions(temperature=0, max_new_tokens=max_tokens)
    chats = [question(i, 0) for i in range(questions)]
    alone = [_token_ids(engine, [engine.generate(chat, options)])[0] for chat in chats]
    together = _token_ids(engine, [engine.generate(chat, options) for chat in chats])
    assert engine.scheduler.batch_sizes[-1] == questions
    return sum(a == b for a, b in zip(alone, together, strict=True)), questions


def _token_ids(engine, generations) -> list[list[int]]:
    """The token ids each generation received (read from its row's queue, as Generation does)."""
    from tunelab.infer.batching import END  # noqa: PLC0415

    engine.start(generations)
    out = []
    for generation in generations:
        ids = []
        while (item := generation._row.tokens.get()) is not END:
            ids.append(item)
        out.append(ids)
    return out


class Server:
    def __init__(self, model: str, max_batch_size: int, threads: int, log: Path):
        env = {**os.environ, "PYTHONPATH": f"{SRC_DIR}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": str(threads)}
        argv = [sys.executable, "-m", "tunelab.cli", "api", model, "--port", "0",
                "--max-batch-size", str(max_batch_size)]
        self.log = log
        with log.open("w") as sink:
            self.process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while not (started := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log.read_text())):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.2)
        self.url = started.group(1) + "/v1"
        self.model_id = Path(model).resolve().name

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def load(server: Server, clients: int, requests: int, max_tokens: int) -> dict[str, float]:
    import openai  # noqa: PLC0415

    apis = [openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=600) for _ in range(clients)]

    def one_client(client: int) -> list[tuple[float, int]]:
        done = []
        for request in range(requests):
            start = time.perf_counter()
            reply = apis[client].chat.completions.create(model=server.model_id, messages=question(client, request),
                                                         temperature=0, max_tokens=max_tokens)
            done.append((time.perf_counter() - start, reply.usage.completion_tokens))
        return done

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = [item for per_client in pool.map(one_client, range(clients)) for item in per_client]
    wall = time.perf_counter() - start
    latencies = sorted(latency for latency, _ in results)
    return {
        "tokens_per_s": sum(tokens for _, tokens in results) / wall,
        "mean_latency_s": statistics.fmean(latencies),
        "p95_latency_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
        "tokens": sum(tokens for _, tokens in results), "requests": len(results), "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model or adapter folder (default: a random ~20M-parameter Llama)")
    parser.add_argument("--clients", default="1,4,8", help="comma-separated numbers of parallel clients")
    parser.add_argument("--requests", type=int, default=4, help="requests per client, sent one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="runs per point; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server (OMP_NUM_THREADS): "
                        "on a shared or small machine, more threads than free cores make every step wait")
    parser.add_argument("--deadline", type=float, default=1200, help="seconds; stop starting new points after it")
    args = parser.parse_args()
    sys.path.insert(0, str(SRC_DIR))
    import torch  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    DATA_DIR.mkdir(exist_ok=True)
    model = args.model or str(random_model(DATA_DIR / "serving-model"))
    clients = [int(n) for n in args.clients.split(",")]

    same, total = check_batched_equals_alone(model, max(clients), args.max_tokens)
    print(f"greedy answers identical batched (one batch of {total}) and alone: {same}/{total}")

    # Both servers up at once and measured in turn, point by point, so that a change in the machine's load
    # (a shared machine) hits both alike; the median of --repeats runs is reported.
    sizes = (1, args.max_batch_size)
    servers = {size: Server(model, size, args.threads, DATA_DIR / f"serving-server-{size}.log") for size in sizes}
    began, runs = time.monotonic(), {}
    try:
        for server in servers.values():
            load(server, 1, 1, args.max_tokens)  # warm-up
        for n in clients:
            for repeat in range(args.repeats):
                for size, server in servers.items():
                    if time.monotonic() - began > args.deadline:
                        print(f"deadline reached: skipping batch size {size}, {n} clients", file=sys.stderr)
                        continue
                    result = load(server, n, args.requests, args.max_tokens)
                    runs.setdefault((size, n), []).append(result)
                    print(f"max batch {size}, {n} clients, run {repeat + 1}: {result['tokens_per_s']:.1f} tokens/s, "
                          f"latency mean {result['mean_latency_s']:.2f} s, p95 {result['p95_latency_s']:.2f} s "
                          f"({result['requests']} requests, {result['tokens']} tokens, {result['wall_s']:.1f} s)",
                          file=sys.stderr)
    finally:
        for server in servers.values():
            server.close()

    median = {key: sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2] for key, results in runs.items()}
    print("\n| max batch size | clients | tokens/s | vs one at a time | mean latency | p95 latency |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (size, n), result in sorted(median.items()):
        base = median.get((1, n))
        gain = f"{result['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "n/a"
        print(f"| {size} | {n} | {result['tokens_per_s']:.1f} | {gain} | {result['mean_latency_s']:.2f} s "
              f"| {result['p95_latency_s']:.2f} s |")


if __name__ == "__main__":
    main()
