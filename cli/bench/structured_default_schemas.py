"""The default schema set of ``flotilla bench structured``: twelve JSON schemas with a prompt each.

What they cover, as the step's acceptance asks: nested objects (two and three
levels), arrays with ``minItems``/``maxItems`` (of strings, of enums, of
objects), enums, integer bounds, numbers, booleans, strings with
``minLength``/``maxLength``. Every object lists all its properties in
``required`` and sets ``additionalProperties: false`` (what OpenAI's
``strict`` mode asks of a schema). Every free string has a ``maxLength``, so
a sampled reply (temperature 0.8) cannot ramble past ``max_tokens`` inside
a string: a reply cut by the length limit is invalid JSON, and that would
measure the limit, not the constraint.

Each valid reply is a few dozen tokens or more, which ``bench structured
overhead`` relies on (its constrained requests should outlast its
``max_tokens``). Held-out sets are JSONL files of the same shape
(``structured_schemas.read_schema_set``).
"""

from __future__ import annotations

from typing import Any


def _obj(**props: Any) -> dict[str, Any]:
    """A strict object schema: every property required, no others."""
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _str(max_length: int, min_length: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def _int(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def _bool() -> dict[str, Any]:
    return {"type": "boolean"}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _array(items: dict[str, Any], min_items: int, max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")

# (name, prompt, schema): names are OpenAI function names (they also name the tool of the forced tool call).
DEFAULT_SCHEMAS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("person", "Invent a person who lives in Europe. Give their name, age and postal address as JSON.",
     _obj(name=_str(40), age=_int(0, 120),
          address=_obj(street=_str(60), city=_str(40), country=_str(40), postcode=_str(10, 3)))),
    ("weather_report", "Write today's weather report for Lisbon as JSON: temperature, sky, wind and humidity.",
     _obj(city=_str(40), temperature_c=_int(-50, 60), condition=_enum("sunny", "cloudy", "rain", "snow", "fog"),
          wind=_obj(speed_kmh=_int(0, 300), direction=_enum("N", "NE", "E", "SE", "S", "SW", "W", "NW")),
          humidity_pct=_int(0, 100))),
    ("shopping_list", "Make a shopping list for a pasta dinner for four people, as JSON.",
     _obj(store=_str(40), items=_array(_obj(name=_str(30), quantity=_int(1, 20), unit=_enum("g", "kg", "ml", "l",
                                                                                            "piece")), 2, 5))),
    ("book_review", "Review a classic novel you like in JSON: title, author, rating, sentiment and a few tags.",
     _obj(title=_str(80), author=_str(60), rating=_int(1, 5), sentiment=_enum("positive", "mixed", "negative"),
          tags=_array(_str(20), 1, 3), summary=_str(200))),
    ("meeting", "Schedule a project kick-off meeting next week and describe it as JSON.",
     _obj(title=_str(60), day=_enum(*WEEKDAYS), start_hour=_int(8, 18), duration_minutes=_int(15, 240),
          attendees=_array(_str(40), 2, 4), remote=_bool())),
    ("recipe", "Give a simple vegetarian soup recipe as JSON with its ingredients in grams.",
     _obj(name=_str(60), servings=_int(1, 12), vegetarian=_bool(),
          ingredients=_array(_obj(item=_str(30), grams=_int(1, 2000)), 3, 6),
          steps=_array(_str(120), 2, 4))),
    ("support_ticket", "A customer writes: 'I was charged twice for my subscription this month.' "
                       "File a support ticket for it as JSON.",
     _obj(category=_enum("billing", "technical", "account", "other"), priority=_enum("low", "medium", "high"),
          summary=_str(120), customer=_obj(id=_int(1, 99999), tier=_enum("free", "pro", "enterprise")),
          refund_requested=_bool())),
    ("movie", "Describe a well-known science-fiction film as JSON: title, year, genres, director and runtime.",
     _obj(title=_str(80), year=_int(1900, 2030),
          genres=_array(_enum("action", "comedy", "drama", "horror", "sci-fi", "thriller", "romance"), 1, 3),
          director=_obj(first_name=_str(30), last_name=_str(30)), runtime_minutes=_int(60, 240))),
    ("flight_booking", "Book a flight for two adults from Paris (CDG) to New York (JFK) in economy, as JSON.",
     _obj(origin=_str(3, 3), destination=_str(3, 3), passengers=_int(1, 9),
          cabin=_enum("economy", "premium", "business", "first"), return_trip=_bool(),
          departure=_obj(year=_int(2024, 2030), month=_int(1, 12), day=_int(1, 31)))),
    ("todo_list", "Write a to-do list for moving to a new flat, as JSON.",
     _obj(owner=_str(40), tasks=_array(_obj(title=_str(60), done=_bool(), priority=_int(1, 3)), 2, 4))),
    ("product", "Describe an office chair for an online shop as JSON: SKU, price, size, colour and stock.",
     _obj(sku=_str(12, 4), name=_str(60), price_eur={"type": "number", "minimum": 0, "maximum": 10000},
          dimensions=_obj(width_cm=_int(1, 500), height_cm=_int(1, 500), depth_cm=_int(1, 500)),
          color=_enum("black", "white", "grey", "red", "blue"), in_stock=_bool())),
    ("sensor_log", "Report the last readings of a temperature sensor in a server room as JSON.",
     _obj(device=_str(30), location=_obj(building=_str(30), floor=_int(-3, 100), room=_obj(name=_str(30),
                                                                                             rack=_int(1, 64))),
          status=_enum("ok", "degraded", "failed"),
          readings=_array(_obj(second=_int(0, 86400), celsius={"type": "number"}), 2, 4))),
)
