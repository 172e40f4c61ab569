"""The instruction prompt that asks an LLM for a site's gold explanation, and its reply parsing.

Modelled on EasyNLA's stage-2 explainer (asherps/EasyNLA nla/datagen/stage2_api_explain.py,
`_DEFAULT_INSTRUCTION`): a few features the LM would use to predict what follows, the last
one about the final token, in a short word budget so the reply fits in max_tokens with its
closing tag. Two differences: the reply is asked for directly inside <explanation> tags
(what nla_core.extract_explanation and the AV's SFT target use, where EasyNLA asks for
<analysis> and rewraps), and the final token is named, since the context alone does not
show where a token boundary falls. Change the text only together with PROMPT_VERSION:
the version is part of every cache key and of the sidecar.
"""

from __future__ import annotations

from typing import Any

from nla_core import extract_explanation

PROMPT_VERSION = "nla-explain-v1"
"""Bumped whenever INSTRUCTION changes, so cached replies to an older prompt are never reused."""

INSTRUCTION = """\
You will see a text that a language model has read up to a certain token. Describe what the \
model is most likely representing at that point: the 2-3 features it would rely on most to \
predict the text that comes next.

Order the features by importance, one short paragraph each (about 10-25 words), with concrete \
words from the text where they help. Consider, for example: syntactic constraints (an open \
bracket or clause), semantic expectations (a list that promised more items), register and \
genre, the direction of an argument or story, repeated patterns. Do not mention that the text \
is cut off; the model only ever sees a prefix.

The last feature must be about the final token, {token}: its role, what it belongs to, and \
what it makes likely next.

Answer with about 60-100 words inside the tags, always closing them:
<explanation>
[most important feature]

[next feature]

[the final token and what it constrains]
</explanation>

Text:
<text>{text}</text>"""
"""The instruction; {text} is the document up to and including the site's token, {token} that token (quoted)."""


def instruction_prompt(context: str, token: str) -> str:
    """The user message that asks for the explanation of the site whose text is `context`, ending in `token`."""
    return INSTRUCTION.format(text=context, token=repr(token))


def parse_reply(reply: str) -> str | None:
    """The explanation inside the reply's <explanation> tags (nla_core's extraction); None if absent or empty."""
    explanation = extract_explanation(reply)
    return explanation or None


def api_summaries(*, model: str, max_tokens: int, temperature: float | None) -> dict[str, Any]:
    """The sidecar's `api_summaries`, with upstream's keys (EasyNLA nla/datagen/sidecar.py NLAApiSummaryMeta).

    `instruction_prompt` is the template with its {text} and {token} placeholders, as upstream
    records its template with {text}.
    """
    return {"model": model, "max_tokens": max_tokens, "temperature": temperature, "instruction_prompt": INSTRUCTION}
