"""The offline Python API, named as vLLM's: ``LLM(model_dir).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from poise.engine.config import EngineConfig
from poise.engine.engine import LLMEngine
from poise.engine.generation_config import check_mode
from poise.engine.intake import RequestOptions
from poise.engine.outputs import RequestOutput
from poise.engine.request import SamplingParams

Prompt = str | dict[str, list[int]]


class LLM:
    def __init__(
        self,
        model: str | Path,
        dtype: str = "auto",
        generation_config: str = "auto",
        **engine_options: Any,
    ) -> None:
        """``generation_config``: ``auto`` takes the model's generation_config.json sampling
        settings as the defaults of calls that pass no SamplingParams; ``none`` does not."""
        self.engine = LLMEngine(
            model,
            EngineConfig(
                dtype=dtype,
                generation_config=check_mode(generation_config),
                **engine_options,
            ),
        )
        self._counter = 0

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given none, as vLLM's: SamplingParams'
        defaults overridden by the model's generation config (mode ``auto``)."""
        return self.engine.generation_config.defaults.sampling_params()

    def generate(
        self,
        prompts: str | Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # Validate every prompt before adding any, so one bad prompt leaves nothing behind.
        prepared = []
        for prompt, sp in zip(prompts, params, strict=True):
            source: str | list[int] = (
                prompt if isinstance(prompt, str) else list(prompt["prompt_token_ids"])
            )
            options = RequestOptions(sp, request_id=str(self._counter))
            prepared.append(self.engine.prepare_request(source, options))
            self._counter += 1
        for request, text in prepared:
            self.engine.add_request(request, text)
        ids = [request.request_id for request, _ in prepared]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate.

        The keyword arguments are vLLM's (``documents`` is transformers'); ``chat_template`` is
        the name of one of the model's templates or a whole template. The template writes the
        special tokens, so the prompt is encoded without adding any.
        """
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.engine.tokenizer
        prompts: list[Prompt] = []
        for conv in conversations:
            text = tok.apply_chat_template(
                conv,  # type: ignore[arg-type]
                add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                documents=documents,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generating") as bar:
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]
