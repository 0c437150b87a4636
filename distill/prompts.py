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
    "Write an email to a friend recommending that they learn about {t}.",
    "Explain {t} as if you were a pirate.",
    "What are the main parts or components of {t}?",
    "Create a short quiz with answers about {t}.",
    "Write a limerick about {t}.",
    "Describe a day in the life of someone who works with {t}.",
    "What are three ways {t} could change in the next fifty years?",
    "Give a one-sentence definition of {t} and then an example.",
    "Write the opening paragraph of a news article about {t}.",
    "How is {t} different in different countries?",
    "What are the ethical questions around {t}?",
    "Summarize what an expert would say about {t} in five bullet points.",
    "Write a motivational speech that mentions {t}.",
    "Explain {t} using only simple words.",
    "What is the most surprising thing about {t}?",
    "Write a recipe-style guide to understanding {t}.",
    "Give a short timeline of key events related to {t}.",
    "Write a children's story about {t}.",
    "What jobs are related to {t}?",
    "Argue for and against the importance of {t} in two short paragraphs.",
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
    "the Eiffel Tower", "electricity", "the Industrial Revolution", "butterflies", "the Sahara desert",
    "submarines", "the human brain", "mushrooms", "the violin", "airplanes", "the pyramids of Giza", "whales",
    "nuclear energy", "the Cold War", "cheese making", "tornadoes", "the alphabet", "spiders", "the Beatles",
    "bridges", "the Mona Lisa", "robots", "vitamins", "the Milky Way", "elephants", "yoga", "the stock exchange", "trains", "soap", "the Vikings", "plastic pollution", "the metric system",
    "the Arctic", "ballet", "chocolate", "the telephone", "wolves", "cloud computing",
    "the Great Depression", "gardening", "sharks", "the US Constitution", "fireworks", "the camera", "honey",
    "the Titanic", "ants", "language learning", "mountains", "the compass", "wine making", "comets", "bats",
    "the human skeleton", "tsunamis", "poetry", "the Mayan civilization", "bees and pollination", "kites",
    "smartphones", "the Black Death", "glass making", "owls", "the speed of light", "skateboarding",
    "the United Nations", "rice farming", "fossils", "the guitar", "supply and demand", "lightning", "cats",
    "the Panama Canal", "blood types", "opera", "the Hubble telescope", "paper", "dolphins", "the Aztecs",
    "antique clocks", "board games", "the rain cycle in cities", "bread", "space stations", "frogs",
    "the Nile river", "magnets", "soccer", "the Middle Ages", "batteries", "tigers", "public transport",
    "photography", "wildfires", "the human eye", "bonsai trees", "the Internet of Things", "salt", "zebras",
    "the Statue of Liberty", "hydropower", "pottery", "the Ice Age", "sign language", "the Olympics of ancient "
    "Greece", "microscopes", "hot air balloons", "astronauts", "crossword puzzles", "the tango", "sunflowers",
    "the stock of fish in oceans", "the invention of writing", "parrots", "clean water", "the Alps",
    "computer viruses", "kangaroos", "the Sun", "carnivals", "insulin", "the Colosseum", "electric guitars",
    "the placebo effect", "jellyfish", "coffee shops", "the Hanseatic League",
    "solar eclipses", "knitting", "the nervous system", "rivers", "artificial intelligence", "maple syrup",
    "the Wright brothers", "snow", "cartography", "volunteering", "the Andes", "urban gardens", "horses",
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

# Free-form requests in no template's shape, never used for training: they measure how far a drafter
# trained on templated prompts generalises (bench/drafter_quality.py reports both held-out sets).
FREEFORM_PROMPTS = [
    "Explain in three sentences why the sky is blue.", "What is the capital of France?",
    "Write a short poem about the sea.", "Give me three tips for better sleep.", "How do I make a cup of tea?",
    "What is machine learning?", "Tell me a joke.", "Summarize the plot of Romeo and Juliet.", "Why do cats purr?",
    "Explain how a rainbow forms.", "What should I pack for a weekend camping trip?",
    "Can you help me write a thank-you note to my teacher?", "What is the difference between weather and climate?",
    "How many legs does a spider have, and why?", "Suggest a name for a small bakery.",
    "What are some healthy breakfast ideas?", "How does a refrigerator keep food cold?",
    "Write a two-line rhyme about Monday mornings.", "Why is exercise good for the brain?",
    "What happens when you mix baking soda and vinegar?", "Describe the smell of rain.",
    "How do airplanes stay in the air?", "What is a good way to start learning to code?",
    "Write a short message wishing a friend happy birthday.",
]

# Self-instruct: the target itself writes the requests it will then answer, so the data covers the
# shapes users send rather than only TASKS. Each meta-prompt asks for one request of some kind about a
# training topic (or about nothing in particular); sampled at a high temperature for variety.
REQUEST_KINDS = [
    "a question", "a short factual question", "a how-to question", "a request for advice",
    "a request to write something creative", "a request to explain something simply",
    "a request to compare two things", "a question a child might ask", "a request for a list of ideas",
    "a casual chat message", "a request to rewrite or improve a sentence", "a request for a recommendation",
]


def self_instruct_meta_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` prompts asking the target to write one user request (kinds × training topics, or open)."""
    rng = random.Random(seed)
    metas = []
    for _ in range(count):
        kind = rng.choice(REQUEST_KINDS)
        if rng.random() < 0.3:
            metas.append(f"Write {kind} that a person might send to an AI assistant. Reply with the request only.")
        else:
            topic = rng.choice(TRAIN_TOPICS)
            metas.append(f"Write {kind} about {topic} that a person might send to an AI assistant. "
                         "Reply with the request only.")
    return metas


def clean_request(text: str, max_chars: int = 300) -> str | None:
    """The request in a target-written reply, or None if it is unusable (empty, too long, held out)."""
    text = text.strip().strip('"').strip()
    for prefix in ("Request:", "Question:", "Here is a request:", "Here's a request:"):
        if text.lower().startswith(prefix.lower()):
            text = text[len(prefix):].strip().strip('"').strip()
    text = text.split("\n\n")[0].strip()
    if len(text) < 8 or len(text) > max_chars or text in FREEFORM_PROMPTS:
        return None
    return text
