"""The word list of the benchmarks' plain-text prompts (`sluice bench serve`'s random-word prompts, the shared
system prompt of `sluice bench prefix`): common English words, each about one token in the usual vocabularies.
"""

WORDS = [
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye",
    "woman", "place", "work", "week", "case", "point", "government", "company", "number", "group",
    "problem", "fact", "river", "stone", "cloud", "light", "music", "garden", "window", "paper", "forest",
    "winter", "harbor", "signal", "market", "bridge", "candle", "silver", "orchard", "meadow", "lantern",
    "canyon",
]
