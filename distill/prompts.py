"""Built-in chat prompts covering varied tasks, split by topic so held-out prompts never leak.

A prompt is a task template filled with a topic. Training prompts use TRAIN_TOPICS, held-out
prompts use HELDOUT_TOPICS (disjoint), so held-out evaluation measures generalisation, not recall.
"""
from __future__ import annotations

import random

TASKS = [
    "Explain {t} to a ten-year-old.",
    "Write a short poem about {t}.",
    "Give me three interesting facts about {t}.",
    "What are the pros and cons of {t}?",
    "Summarize the history of {t} in a few sentences.",
    "Write a haiku about {t}.",
    "How would you teach a beginner about {t}?",
    "Write a short story that involves {t}.",
    "List five questions a student might ask about {t}.",
    "Describe {t} in one paragraph.",
    "What is a common misconception about {t}?",
    "Write a tweet announcing a new discovery about {t}.",
    "Compare {t} with something from everyday life.",
    "Give step-by-step advice for someone interested in {t}.",
    "Why does {t} matter today?",
    "Write a dialogue between two friends discussing {t}.",
    "Translate the idea of {t} into a simple metaphor.",
    "What would happen if {t} disappeared tomorrow?",
    "Write a product description for a book about {t}.",
    "Answer briefly: what is {t}?",
]

TRAIN_TOPICS = [
    "photosynthesis", "the French Revolution", "black holes", "machine learning", "volcanoes", "honey bees",
    "the stock market", "climate change", "the human heart", "jazz music", "the Roman Empire", "electric cars",
    "vaccines", "the internet", "coffee", "chess", "the moon landing", "rainforests", "gravity", "democracy",
    "recycling", "the printing press", "sleep", "earthquakes", "the piano", "social media", "the ocean tides",
    "ancient Egypt", "solar panels", "friendship", "the Great Wall of China", "DNA", "bicycles", "inflation",
    "the water cycle", "Shakespeare", "meditation", "dinosaurs", "3D printing", "the Olympic Games",
    "bread baking", "hurricanes", "the immune system", "prime numbers", "the Renaissance", "coral reefs",
    "time zones", "rainbows", "penguins", "cryptography",
]

HELDOUT_TOPICS = [
    "tea ceremonies", "glaciers", "the Silk Road", "quantum computers", "octopuses", "public libraries",
    "wind turbines", "origami", "the Amazon river", "antibiotics", "marathon running", "lighthouses",
    "the periodic table", "street food", "satellites", "bamboo", "the Moon's phases", "typewriters",
    "desert ecosystems", "video games",
]


def prompts(topics: list[str], count: int, seed: int) -> list[str]:
    """`count` distinct task/topic combinations (cycling if more are asked than exist)."""
    combos = [task.format(t=topic) for topic in topics for task in TASKS]
    random.Random(seed).shuffle(combos)
    return [combos[i % len(combos)] for i in range(count)]


def train_prompts(count: int, seed: int = 0) -> list[str]:
    """Prompts for generating training data."""
    return prompts(TRAIN_TOPICS, count, seed)


def heldout_prompts(count: int, seed: int = 1) -> list[str]:
    """Prompts for evaluation; no topic is shared with train_prompts."""
    return prompts(HELDOUT_TOPICS, count, seed)
