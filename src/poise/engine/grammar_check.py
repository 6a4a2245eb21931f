"""Each new grammar tried in a process of its own, within a time limit, before a request queues.

llguidance validates a grammar's text cheaply, but some grammars only show their cost, or kill
the process, when a matcher is built against the model's tokenizer and asked for its first mask:
a JSON schema of a thousand ``$ref`` links overflows the compiler's stack (SIGSEGV, the whole
server gone), and a regex of nested counted repetitions takes seconds for its first mask, or
fails at its first character. So the front end hands each grammar it has not seen to a child
process that builds a matcher and computes a mask, then consumes one allowed token and computes
the next; a crash there, or no answer within ``time_limit_s``, is the request's 400,
and the child is started again for the next one. Verdicts are cached by grammar text.

The child builds its matcher in a thread, as the engine core does, so a grammar deep enough to
overflow a thread's stack fails here first. No library does this isolation for us: this module
exists because the grammar engine's failure modes include taking the process with it.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

_CACHED = 256


def _child(conn: Connection, tokenizer_json: str, vocab_size: int, eos: list[int]) -> None:
    from llguidance import LLMatcher, LLTokenizer

    tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)

    def verdict(grammar: str) -> str | None:
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            return short_error(messages[0] if messages else "the grammar does not compile")
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if not matcher.is_error():
            bits = int.from_bytes(matcher.compute_bitmask(), "little")
            # And one token further: some grammars only fail once the lexer starts on input
            # (a nested counted regex overflows its expression limit at its first character).
            if bits and not matcher.is_error():
                first = (bits & -bits).bit_length() - 1
                if matcher.consume_token(first) and not matcher.is_stopped():
                    matcher.compute_bitmask()
        return short_error(matcher.get_error()) if matcher.is_error() else None

    while True:
        try:
            grammar = conn.recv()
        except EOFError:
            return
        out: list[str | None] = [None]

        def run(grammar: str = grammar, out: list[str | None] = out) -> None:
            try:
                out[0] = verdict(grammar)
            except BaseException as exc:  # a Rust panic is a BaseException
                out[0] = short_error(f"{type(exc).__name__}: {exc}")

        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        conn.send(out[0])


def short_error(message: str, limit: int = 300) -> str:
    """llguidance's errors can carry the parser's state and the whole grammar: the start says
    what went wrong."""
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + " ..."


class GrammarChecker:
    """Verdicts on grammars (None: fine; else why not), from a child process; thread-safe."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos: list[int], time_limit_s: float = 1.0
    ) -> None:
        self._args: tuple[Any, ...] = (tokenizer_json, vocab_size, eos)
        self.time_limit_s = time_limit_s
        self._lock = threading.Lock()
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()
        self._process: Any = None
        self._conn: Connection | None = None

    def _start(self) -> Connection:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_child, args=(child, *self._args), daemon=True, name="poise-grammar-check"
        )
        self._process.start()
        child.close()
        self._conn = parent
        # The first answer waits for the child's start and tokenizer too: not the grammar's.
        parent.send('start: "a"')
        if not parent.poll(60) or parent.recv() is not None:
            self._stop()
            raise RuntimeError("the grammar checker did not start")
        return parent

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(5)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None

    def check(self, grammar: str) -> str | None:
        with self._lock:
            if grammar in self._verdicts:
                self._verdicts.move_to_end(grammar)
                return self._verdicts[grammar]
            verdict = self._ask(grammar)
            self._verdicts[grammar] = verdict
            if len(self._verdicts) > _CACHED:
                self._verdicts.popitem(last=False)
            return verdict

    def _ask(self, grammar: str) -> str | None:
        conn = self._conn if self._conn is not None else self._start()
        try:
            conn.send(grammar)
            if not conn.poll(self.time_limit_s):
                self._stop()
                return (
                    f"the grammar engine needs more than {self.time_limit_s:g} s to start "
                    "this constraint; simplify it"
                )
            answer: str | None = conn.recv()
            return answer
        except (EOFError, OSError):
            code = None if self._process is None else self._process.exitcode
            self._stop()
            return f"this constraint crashed the grammar engine (exit code {code}); simplify it"

    def close(self) -> None:
        with self._lock:
            self._stop()
