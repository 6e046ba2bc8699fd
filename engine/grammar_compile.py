"""Compiling grammars off the step thread, with a cache keyed by the grammar and a deadline.

    submit(spec) ──► cached Future, or a new one compiled on a daemon thread of its own
    compile(spec) ─► submit, then wait at most ``deadline_s``: the compiled grammar, or GrammarError
                     (the grammar does not compile, or did not within the deadline)

A compile cannot be interrupted: one past the deadline finishes in the background and its result is
cached (a later request for the same grammar gets it at once); its thread is a daemon, so a runaway
compile never holds a process open. A failed compile is cached too: the same bad schema is refused at
once. The cache keeps the ``MAX_CACHED`` most recently submitted grammars.

Callers: the HTTP layer compiles a request's grammar before anything is queued (a failure is a 400
naming the field, app.generation); a worker's engine loop compiles it before adding the request
(actors.engine_loop), so the engine's own ``matcher`` call, on the step thread, is a cache hit.
The tokenizer's grammar tables are built once, on the first grammar (about a second for a 49k
vocabulary), never for an engine that serves no grammar.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Sequence

from engine.grammar import GrammarError, GrammarSpec, Matcher

COMPILE_DEADLINE_S = 10.0
MAX_CACHED = 256


class GrammarCompiler:
    """Compiles ``GrammarSpec``s for one tokenizer and a model's vocabulary (logits width)."""

    def __init__(self, hf_tokenizer, vocab_size: int, deadline_s: float = COMPILE_DEADLINE_S) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.deadline_s = deadline_s
        self._compiler = None  # xgrammar.GrammarCompiler, built with the first grammar
        self._lock = threading.Lock()  # the cache
        self._build_lock = threading.Lock()  # the tokenizer's tables (a second, not under the cache's lock)
        self._cache: OrderedDict[GrammarSpec, concurrent.futures.Future] = OrderedDict()
        self.num_compiles = 0

    def submit(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """The compile of ``spec``: cached, or started now on a thread of its own."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._cache[spec] = concurrent.futures.Future()
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
            self.num_compiles += 1
        threading.Thread(target=self._run, args=(spec, future), name="grammar-compile", daemon=True).start()
        return future

    def compile(self, spec: GrammarSpec, deadline_s: float | None = None):
        """The compiled grammar; GrammarError if it does not compile within the deadline."""
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        try:
            return self.submit(spec).result(timeout=deadline_s)
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"the {_name(spec)} did not compile within {deadline_s:g} s") from None

    def matcher(self, spec: GrammarSpec, stop_token_ids: Sequence[int]) -> Matcher:
        """A fresh matcher (nothing accepted) that ends the output on any of ``stop_token_ids``."""
        import xgrammar

        if not stop_token_ids:
            raise GrammarError("a grammar needs a stop token to end the output on (EOS or stop_token_ids)")
        return Matcher(xgrammar.GrammarMatcher(self.compile(spec), override_stop_tokens=list(stop_token_ids)))

    def _run(self, spec: GrammarSpec, future: concurrent.futures.Future) -> None:
        try:
            compiled = self._compile(spec)
        except Exception as exc:  # any failure of the library is the grammar's: the caller gets a 400
            future.set_exception(GrammarError(f"the {_name(spec)} does not compile: {exc}"))
        else:
            future.set_result(compiled)

    def _compile(self, spec: GrammarSpec):
        compiler = self._xgrammar_compiler()
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.source, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "choice":
            return compiler.compile_grammar(spec.as_ebnf_choice())
        if spec.kind == "structural_tag":
            return compiler.compile_structural_tag(spec.source)
        return compiler.compile_grammar(spec.source)

    def _xgrammar_compiler(self):
        with self._build_lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(self.hf_tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


def _name(spec: GrammarSpec) -> str:
    return {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
            "choice": "choice", "ebnf": "grammar",
            "structural_tag": "tool-call grammar"}[spec.kind]
