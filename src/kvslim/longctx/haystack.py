"""A haystack of exactly ``length`` tokens holding the inserted sentences of some task instances, and the question
pieces fed after it (issue 34).

The prompt is assembled in token space: the chat template's head, then filler sentences and inserted sentences,
each tokenized on its own with a leading space (a word boundary for byte-level BPE tokenizers), cut to exactly
``length`` tokens. So every inserted sentence's token position is known, and the prefix is the same for every
question asked about it: one prefill serves every question and every cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .tasks import Instance

MARK = "\x00HAYSTACK\x00"
INTRO = "Some special magic numbers, a pass key and some variables are hidden in the following text. Remember them."


@dataclass
class Question:
    """One question about a haystack: its instance, the ids fed after the haystack (question, end of the user turn,
    the assistant's answer prefix), and the token positions of the instance's inserted sentences."""

    instance: Instance
    ids: torch.Tensor  # (1, Q)
    positions: tuple[int, ...]
    depth_measured: float  # token position of the first inserted sentence over the haystack length

    @property
    def task(self) -> str:
        return self.instance.task


@dataclass
class Haystack:
    ids: torch.Tensor  # (1, length)
    questions: list[Question]


def _pieces(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def template(tokenizer) -> tuple[str, str]:
    """(head, tail) around the user's message: the tokenizer's chat template with a generation prompt when it has
    one, else a plain layout ("" and "\\nAnswer:")."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                                 add_generation_prompt=True)
        if isinstance(rendered, str) and rendered.count(MARK) == 1:
            head, tail = rendered.split(MARK)
            return head, tail
    return "", "\nAnswer:"


def build(tokenizer, instances: list[Instance], length: int, units: list[str], rng: random.Random) -> Haystack:
    """The haystack of exactly ``length`` tokens (head, intro, filler with the inserted sentences) and one
    :class:`Question` per instance. ``ValueError`` when ``length`` leaves no room for the filler."""
    head, tail = template(tokenizer)
    head_ids = tokenizer(head + INTRO).input_ids  # special tokens (BOS) as the tokenizer adds them
    inserts = sorted(((d, i, j, _pieces(tokenizer, " " + s)) for i, inst in enumerate(instances)
                      for j, (d, s) in enumerate(inst.inserts)), key=lambda x: x[0])
    needle_tokens = sum(len(x[3]) for x in inserts)
    budget = length - len(head_ids) - needle_tokens
    if budget < 2 * len(inserts) + 8:
        raise ValueError(f"length={length} leaves {budget} filler tokens after the template ({len(head_ids)}) "
                         f"and the inserted sentences ({needle_tokens}); ask for a longer context")
    filler: list[list[int]] = []
    got, k = 0, rng.randrange(len(units))
    while got < budget:
        piece = _pieces(tokenizer, " " + units[k % len(units)])[: budget - got]
        filler.append(piece)
        got += len(piece)
        k += 1
    bounds = [0]
    for piece in filler:
        bounds.append(bounds[-1] + len(piece))
    ids = list(head_ids)
    positions = {i: [0] * len(inst.inserts) for i, inst in enumerate(instances)}  # in each instance's own order
    j = 0
    for d, i, n, piece in inserts:
        # the sentence boundary nearest the depth (of the filler), after what is already laid
        target = d * budget
        b = min(range(j, len(bounds)), key=lambda x: abs(bounds[x] - target))
        for piece_f in filler[j:b]:
            ids += piece_f
        j = b
        positions[i][n] = len(ids)
        ids += piece
    for piece_f in filler[j:]:
        ids += piece_f
    assert len(ids) == length, (len(ids), length)
    questions = []
    for i, inst in enumerate(instances):
        q_ids = _pieces(tokenizer, "\n\n" + inst.question + tail + inst.answer_prefix)
        questions.append(Question(inst, torch.tensor([q_ids]), tuple(positions[i]), positions[i][0] / length))
    return Haystack(torch.tensor([ids]), questions)
