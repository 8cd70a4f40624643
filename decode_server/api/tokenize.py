"""POST /tokenize and /detokenize, as vLLM serves them: a prompt's (or a conversation's, through the chat template)
token ids with the server's own tokenizer, and the text of token ids. Clients count tokens with them, and build
token-id prompts that the generation routes then take as they are.

/tokenize: `{"prompt": str, "add_special_tokens": true}` or `{"messages": [...], "add_generation_prompt": true,
"chat_template_kwargs": {...}, "tools": [...]}` (one of them), `return_token_strs` → `{"count", "max_model_len",
"tokens", "token_strs"}`. A text longer than the context is counted, not refused (nothing is generated).
/detokenize: `{"tokens": [ids]}` → `{"prompt": text}` (special tokens kept: the exact inverse).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from decode_server.api.protocol import ChatMessage, ToolDefinition, _Strict
from decode_server.errors import InvalidRequestError

MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = Field(default=None, description="default: true for a prompt, false for "
                                            "messages (the chat template writes them)")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_DETOKENIZE_TOKENS)


class DetokenizeResponse(BaseModel):
    prompt: str


class Tokenization:
    def __init__(self, serving: Any) -> None:
        self.serving = serving  # serving.OpenAIServing: the model check, the tokenizer and its worker pool

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        serving = self.serving
        serving._check_model(req.model)
        pool, tokenizer = serving.tokenizer_pool, serving.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give exactly one of 'prompt' and 'messages'", param="prompt")
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = (await pool.encode(req.prompt, special) if pool is not None
                   else tokenizer.encode(req.prompt, add_special_tokens=special))  # fmt: skip
        else:
            messages = [m.template_dict() for m in req.messages or []]
            kwargs = dict(req.chat_template_kwargs or {})
            if req.tools:
                kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
            try:
                if pool is not None and not req.add_special_tokens:  # large conversations render off the loop
                    ids = await pool.encode_chat(messages, req.add_generation_prompt, template_kwargs=kwargs)
                else:  # the template writes its special tokens; `add_special_tokens` adds the tokenizer's own too
                    text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                         **kwargs)
                    ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
            except Exception as exc:  # the template raises (raise_exception) on conversations it cannot render
                raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
        assert isinstance(ids, list)
        strs = [serving._token_text(t) for t in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=serving.model.context_length, tokens=ids,
                                token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        serving = self.serving
        serving._check_model(req.model)
        vocab = serving.model.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {req.tokens[bad]} is outside the vocabulary (size {vocab})",
                                      param=f"tokens.{bad}")
        return DetokenizeResponse(prompt=serving.tokenizer.decode(req.tokens, skip_special_tokens=False))
