"""A small stand-in for ``vllm serve``: the endpoints the vllm-server engine uses, a
deterministic model, and faults on request (errors, cut streams, stalls, a server that
goes away), for what a real server cannot be made to do on cue.

The model writes ``plan`` (token ids) and then EOS. Where a prompt already ends with the
plan's first k ids (a resumed segment's kept ids), it goes on from the k-th: a resume over the
kept ids continues the uninterrupted output, as a real model's greedy decoding does. A
request whose ``vllm_xargs`` carry forced ids gets those ids, as the servers' processor would
give them (``processor=False``: a server without it, which ignores them).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from timelyllm_ros.engines.real import common_prefix

FORCED_KEY = 'timelyllm_forced_ids'


@dataclass
class Behaviour:
    """What the server does, changeable while it runs."""

    processor: bool = True               # honours forced ids (the servers' processor)
    token_delay_s: float = 0.0           # between streamed tokens
    status: int = 200                    # a completion's HTTP status (e.g. 400, 500)
    cut_after: int | None = None         # close the stream after this many tokens, unended
    stall: bool = False                  # accept a completion and send nothing
    error_chunk_after: int | None = None  # send vLLM's error chunk after this many tokens
    torn_after: int | None = None        # send half an event after this many tokens, close


@dataclass
class Served:
    """What the server saw."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    disconnects: int = 0                 # streams the client closed before their end


class FakeVllmServer:
    """A fake ``vllm serve`` on a free local port (``url``)."""

    def __init__(self, plan: Sequence[int], eos: int, model: str = 'fake-model',
                 max_model_len: int = 2048, behaviour: Behaviour | None = None) -> None:
        self.plan = list(plan)
        self.eos = eos
        self.model = model
        self.max_model_len = max_model_len
        self.behaviour = behaviour or Behaviour()
        self.served = Served()
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._computed: list[list[int]] = []     # prompts and outputs the server computed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = ThreadingHTTPServer(('127.0.0.1', 0), self._handler())
        self._server.daemon_threads = True
        self.url = f'http://127.0.0.1:{self._server.server_address[1]}'
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Go away: close the listening socket and every open stream."""
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    def continuation(self, prompt: Sequence[int]) -> list[int]:
        """What the model writes after ``prompt``: the plan from where the prompt left it."""
        for k in range(min(len(self.plan), len(prompt)), 0, -1):
            if list(prompt[-k:]) == self.plan[:k]:
                return self.plan[k:] + [self.eos]
        return self.plan + [self.eos]

    def serve_prompt(self, prompt: Sequence[int]) -> None:
        """Count a request's prompt in the prefix-cache counters, as vLLM does: the full
        16-token blocks it shares with what the server computed before are hits."""
        shared = max((common_prefix(prompt, seen) for seen in self._computed), default=0)
        shared = min(shared, len(prompt) - 1) // 16 * 16
        self.prefix_queries += len(prompt)
        self.prefix_hits += shared

    def metrics(self) -> str:
        queries, hits = self.prefix_queries, self.prefix_hits
        return ('# HELP vllm:kv_cache_usage_perc KV-cache usage.\n'
                '# TYPE vllm:kv_cache_usage_perc gauge\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="{self.model}"}} 0.25\n'
                '# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n'
                '# TYPE vllm:cache_config_info gauge\n'
                'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
                '# HELP vllm:prefix_cache_queries Prefix cache queries.\n'
                '# TYPE vllm:prefix_cache_queries counter\n'
                f'vllm:prefix_cache_queries_total{{engine="0"}} {queries}.0\n'
                '# HELP vllm:prefix_cache_hits Prefix cache hits.\n'
                '# TYPE vllm:prefix_cache_hits counter\n'
                f'vllm:prefix_cache_hits_total{{engine="0"}} {hits}.0\n')

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _send(self, status: int, body: str, kind: str = 'application/json') -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header('Content-Type', kind)
                self.send_header('Content-Length', str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == '/v1/models':
                    self._send(200, json.dumps({'object': 'list', 'data': [
                        {'id': server.model, 'object': 'model',
                         'max_model_len': server.max_model_len}]}))
                elif self.path == '/health':
                    self._send(200, '')
                elif self.path == '/metrics':
                    self._send(200, server.metrics(), 'text/plain; version=0.0.4')
                else:
                    self._send(404, '{}')

            def do_POST(self) -> None:
                length = int(self.headers.get('Content-Length', 0))
                body = json.loads(self.rfile.read(length))
                with server._lock:
                    server.served.requests.append(body)
                behaviour = server.behaviour
                if behaviour.status != 200:
                    self._send(behaviour.status, json.dumps(
                        {'error': {'message': 'refused on purpose', 'code': behaviour.status}}))
                    return
                forced = (body.get('vllm_xargs') or {}).get(FORCED_KEY)
                tokens = ([int(t) for t in forced] if forced and behaviour.processor
                          else server.continuation(body['prompt']))
                tokens = tokens[:int(body.get('max_tokens') or 16)]
                with server._lock:
                    server.serve_prompt(body['prompt'])
                    server._computed.append(list(body['prompt']) + tokens)
                ends_eos = tokens[-1] == server.eos
                reason = 'stop' if ends_eos else 'length'
                if not body.get('stream'):
                    self._send(200, json.dumps({'choices': [
                        {'index': 0, 'text': '', 'token_ids': tokens,
                         'finish_reason': reason}]}))
                    return
                self.send_response(200)
                self.send_header('Content-Type', 'text/event-stream')
                self.end_headers()
                try:
                    self._stream(body, tokens, reason)
                except (BrokenPipeError, ConnectionResetError):
                    with server._lock:
                        server.served.disconnects += 1

            def _stream(self, body: dict[str, Any], tokens: list[int], reason: str) -> None:
                behaviour = server.behaviour
                if behaviour.stall:
                    while not server._stop.wait(0.05):
                        pass
                    return
                for index, token in enumerate(tokens):
                    if server._stop.is_set() or index == behaviour.cut_after:
                        return
                    if index == behaviour.torn_after:
                        self.wfile.write(b'data: {"choices": [{"index": 0, "tok')
                        self.wfile.flush()
                        return
                    if index == behaviour.error_chunk_after:
                        self._event({'error': {'message': 'EngineCore encountered an issue',
                                               'code': 500}})
                        return
                    last = index == len(tokens) - 1
                    # vLLM leaves EOS out of token_ids when it ends a completion on it
                    ids = [] if last and token == server.eos else [token]
                    choice: dict[str, Any] = {'index': 0, 'text': '', 'token_ids': ids,
                                              'finish_reason': reason if last else None}
                    if index == 0:
                        choice['prompt_token_ids'] = body['prompt']
                    self._event({'choices': [choice]})
                    if behaviour.token_delay_s:
                        time.sleep(behaviour.token_delay_s)
                self.wfile.write(b'data: [DONE]\n\n')
                self.wfile.flush()

            def _event(self, data: dict[str, Any]) -> None:
                self.wfile.write(f'data: {json.dumps(data)}\n\n'.encode())
                self.wfile.flush()

        return Handler

