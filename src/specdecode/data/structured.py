"""``bench structured``'s prompts: each with the JSON schema its answer must follow.

Two suites: ``extraction`` (records pulled out of a short text, or a schema filled from a description) and
``classification`` (a label, and for some a confidence, chosen for a text).  Each schema bounds what it asks for,
so that a small model's answer completes within a modest token budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredPrompt:
    id: str
    suite: str
    text: str
    schema: dict[str, Any]


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    """An object with exactly these properties, all required (OpenAI's strict mode asks for this shape)."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


_TEXT = {"type": "string", "maxLength": 60}
_PERSON = _object({"name": _TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 130}, "city": _TEXT})
_DATE = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
_EVENT = _object({"title": _TEXT, "date": _DATE, "place": _TEXT})
_ORDER = _object(
    {
        "customer": _TEXT,
        "items": {
            "type": "array",
            "items": _object({"product": _TEXT, "quantity": {"type": "integer", "minimum": 1, "maximum": 99}}),
            "minItems": 1,
            "maxItems": 4,
        },
        "express": {"type": "boolean"},
    }
)
_BOOK = _object(
    {
        "title": _TEXT,
        "author": _TEXT,
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        "genres": {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 3},
    }
)
_SENTIMENT = _object({"sentiment": {"enum": ["positive", "negative", "neutral"]}})
_TOPIC = _object(
    {
        "topic": {"enum": ["sports", "politics", "technology", "health", "business"]},
        "confidence": {"enum": ["low", "medium", "high"]},
    }
)
_INTENT = _object({"intent": {"enum": ["refund", "shipping", "cancel_order", "product_question", "other"]}})

STRUCTURED_PROMPTS: tuple[StructuredPrompt, ...] = (
    StructuredPrompt(
        "person-1",
        "extraction",
        "Extract the person as JSON with name, age and city: Maria Lopez is 42 and moved to Lisbon last spring.",
        _PERSON,
    ),
    StructuredPrompt(
        "person-2",
        "extraction",
        "Extract the person as JSON with name, age and city: At 29, Kenji Watanabe runs a small bakery in Osaka.",
        _PERSON,
    ),
    StructuredPrompt(
        "event",
        "extraction",
        "Extract the event as JSON with title, date (YYYY-MM-DD) and place: The Harbour Jazz Night takes place on "
        "14 June 2025 at the Old Pier in Bristol.",
        _EVENT,
    ),
    StructuredPrompt(
        "order",
        "extraction",
        "Extract the order as JSON (customer, items with product and quantity, express delivery or not): Tom Becker "
        "ordered two blue mugs and one teapot, with express delivery.",
        _ORDER,
    ),
    StructuredPrompt(
        "book",
        "extraction",
        "Describe a well-known novel as JSON with its title, author, year of publication and up to three genres.",
        _BOOK,
    ),
    StructuredPrompt(
        "sentiment-1",
        "classification",
        "Classify the sentiment of this review as JSON: 'The battery lasts two days and the screen is gorgeous.'",
        _SENTIMENT,
    ),
    StructuredPrompt(
        "sentiment-2",
        "classification",
        "Classify the sentiment of this review as JSON: 'It broke after a week and support never answered.'",
        _SENTIMENT,
    ),
    StructuredPrompt(
        "topic",
        "classification",
        "Classify the topic of this headline as JSON, with your confidence: 'Central bank raises interest rates "
        "for the third time this year'.",
        _TOPIC,
    ),
    StructuredPrompt(
        "intent",
        "classification",
        "Classify the customer's intent as JSON: 'Hi, my parcel was supposed to arrive on Monday and it is still not "
        "here. Where is it?'",
        _INTENT,
    ),
)

STRUCTURED_SUITES = ("extraction", "classification")
