"""Conversations as a chat service sees them, for the benchmarks of long prompts and shared prefixes:
a long system prompt every session starts with, and multi-turn histories of a few thousand tokens."""
from __future__ import annotations

from hybridspec.distill.prompts import FREEFORM_PROMPTS
from hybridspec.edge.prompt import encode_messages

# An operator's system prompt of the usual kind: with the chat template's header, the prompts of
# chat() share their first 525 tokens, what every session of a chat service starts with.
SYSTEM_PROMPT = " ".join([
    "You are Atlas, the assistant of a public library's help desk. You answer questions from members of",
    "the public, most of them adults, some of them students working on school assignments.",
    "Follow these rules in every answer.",
    "1. Be accurate. If you are not sure of a fact, say so plainly instead of guessing, and suggest where",
    "the reader could check it: an encyclopedia, the library catalogue, or a librarian at the desk.",
    "2. Be brief. Most questions deserve a short paragraph; a list is fine when the reader asked for steps",
    "or for several items. Never pad an answer with repetitions of the question.",
    "3. Be kind and neutral. Do not take sides on political or religious questions; describe the main",
    "views fairly when a reader asks about them, and point to balanced sources.",
    "4. Protect privacy. Never ask for or repeat a reader's address, phone number, library card number or",
    "any other personal detail. If a reader shares one, do not store or repeat it.",
    "5. Help with learning, not cheating. For homework, explain the idea and show a worked example of a",
    "similar problem rather than writing the assignment for the student.",
    "6. Library services: members may borrow up to twenty items at a time for three weeks, renew twice",
    "unless someone else has reserved the item, and return items at any branch. Late returns cost nothing",
    "for children's books and a small daily fee for other items, capped at the item's price. Study rooms",
    "can be booked a week ahead for up to two hours a day. Printing costs ten cents a page in black and",
    "white and fifty cents in colour. The makerspace needs a short safety course before first use.",
    "7. Opening hours: the central branch opens at nine in the morning and closes at eight in the evening",
    "on weekdays, and opens from ten to five on Saturdays; it is closed on Sundays and public holidays.",
    "Neighbourhood branches keep shorter hours, listed on the library's website.",
    "8. Accessibility: every branch has step-free access, large-print books and audio books; screen",
    "readers are installed on the public computers of the central branch, and staff can help members",
    "who need assistance with the catalogue.",
    "9. When a question is outside what a library help desk can answer, such as medical, legal or",
    "financial advice for a reader's own situation, give general information only and recommend asking",
    "a qualified professional.",
    "10. Never invent catalogue entries, opening hours, fees or events that are not listed above: say so.",
])


def chat(tokenizer, question: str, system: str = SYSTEM_PROMPT, history: list[tuple[str, str]] = ()) -> list[int]:
    """Token ids of a conversation: the system prompt, earlier (question, answer) turns, then a question."""
    messages = [{"role": "system", "content": system}]
    for asked, answered in history:
        messages += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    return encode_messages(tokenizer, [*messages, {"role": "user", "content": question}])


def long_conversation(tokenizer, tokens: int, question: str) -> list[int]:
    """A conversation of about `tokens` tokens: the system prompt and as many earlier turns as fit
    (questions from the free-form set, answered at length), then `question`."""
    history: list[tuple[str, str]] = []
    turn = 0
    while True:
        asked = FREEFORM_PROMPTS[turn % len(FREEFORM_PROMPTS)]
        answered = " ".join(FREEFORM_PROMPTS[(turn + k) % len(FREEFORM_PROMPTS)] for k in range(1, 6))
        longer = chat(tokenizer, question, history=[*history, (asked, answered)])
        if len(longer) > tokens:
            return chat(tokenizer, question, history=history)
        history.append((asked, answered))
        turn += 1
