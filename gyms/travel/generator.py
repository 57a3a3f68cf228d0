"""Seeded TravelGym scenarios: UserRL's scenario files are not public, so scenarios are generated from their ids.

A scenario id has UserRL's form, `flight:3-114|hotel:2-36|rental_car:3-65`: one `aspect:<preferences>-<k>` piece
per travel aspect. The id alone determines the scenario: the trip (cities, dates, the user's request, the
ground-truth search arguments) is drawn from the whole id, each aspect's hidden preferences from its piece (so
`hotel:2-36` means the same preferences in every scenario), and the options from both. Per aspect the options
are `correct` (match the request and satisfy every preference), `wrong` (violate one or two preferences; about
half are cheaper than the best) and `noise` (do not match the request); the best option is the cheapest
correct one. Option ids are the aspect's initial and a number (F3, H11), in shuffled order.
"""

import datetime
import random
import re
from typing import Any

from gyms.travel.catalog import (
    ASPECT_INITIALS,
    CITIES,
    PREFERENCE_KINDS,
    Option,
    PreferenceKind,
    Rng,
    finish_flight,
    new_apartment,
    new_car,
    new_flight,
    new_hotel,
    new_restaurant,
)

_PIECE = re.compile(r"^(flight|hotel|apartment|restaurant|rental_car):([1-5])-([A-Za-z0-9]+)$")
COST_FIELD = {"restaurant": "price_per_person"}
# (low, high, step) of the price; stays and rentals are per night / day and multiplied by the length of the trip.
PRICES = {
    "flight": (120, 950, 5),
    "hotel": (90, 450, 5),
    "apartment": (110, 500, 5),
    "restaurant": (15, 120, 1),
    "rental_car": (30, 120, 1),
}
CORRECT_OPTIONS = (2, 4)  # range of correct options per aspect


def parse_scenario_id(scenario_id: str) -> list[tuple[str, int, str]]:
    """[(aspect, number of preferences, piece)] of a scenario id; ValueError if it is not one."""
    pieces = scenario_id.split("|")
    out = []
    for piece in pieces:
        m = _PIECE.match(piece)
        if m is None:
            raise ValueError(
                f"{scenario_id!r} is not a TravelGym scenario id like 'flight:2-37|hotel:2-9' "
                f"(aspects: {', '.join(ASPECT_INITIALS)}; 1-5 preferences each)"
            )
        out.append((m.group(1), int(m.group(2)), piece))
    if len({a for a, _, _ in out}) != len(out):
        raise ValueError(f"{scenario_id!r} names an aspect twice")
    return out


def generate_scenario(scenario_id: str, wrong: int = 10, noise: int = 5) -> dict[str, Any]:
    """The scenario of `scenario_id` with `wrong` wrong and `noise` noise options per aspect (about 1 ms)."""
    aspects = parse_scenario_id(scenario_id)
    rng = random.Random(f"travel:{scenario_id}")
    trip = _trip(rng, [a for a, _, _ in aspects])
    preferences: list[dict[str, Any]] = []
    out_aspects: dict[str, Any] = {}
    for aspect, count, piece in aspects:
        kinds = _pick_kinds(aspect, count, piece)
        for kind in kinds:
            preferences.append(
                {
                    "id": f"P{len(preferences) + 1}",
                    "aspect": aspect,
                    "subcategory": kind.subcategory,
                    "preference": kind.text,
                    "implicit_elicitation": kind.implicit,
                }
            )
        options, correct_ids, best_id = _options(rng, aspect, kinds, trip, wrong, noise)
        out_aspects[aspect] = {
            "arguments": trip["arguments"][aspect],
            "options": options,
            "correct_ids": correct_ids,
            "best_id": best_id,
        }
    return {
        "id": scenario_id,
        "dimensions": [a for a, _, _ in aspects],
        "scenario": f"A traveller is planning a trip to {trip['destination']}.",
        "initial_description": trip["description"],
        "preferences": preferences,
        "aspects": out_aspects,
    }


def _pick_kinds(aspect: str, count: int, piece: str) -> list[PreferenceKind]:
    rng = random.Random(f"travel-preferences:{piece}")
    kinds = PREFERENCE_KINDS[aspect](rng)
    rng.shuffle(kinds)
    picked: list[PreferenceKind] = []
    for kind in kinds:
        if len(picked) < count and all(kind.key != p.key for p in picked):
            picked.append(kind)
    if len(picked) < count:
        raise ValueError(f"{piece!r}: {aspect} has only {len(picked)} compatible preference kinds")
    return picked


def _trip(rng: Rng, aspects: list[str]) -> dict[str, Any]:
    origin, destination = rng.sample(CITIES, 2)
    nights = rng.randint(3, 9)
    start = datetime.date(2025, rng.randint(1, 12), rng.randint(1, 18))
    end = start + datetime.timedelta(days=nights)
    dinner = start + datetime.timedelta(days=rng.randint(1, nights - 1))
    iso = {"start": start.isoformat(), "end": end.isoformat(), "dinner": dinner.isoformat()}
    spoken = {k: _spoken(datetime.date.fromisoformat(v)) for k, v in iso.items()}
    arguments = {
        "flight": {"origin": origin, "destination": destination, "date": iso["start"]},
        "hotel": {"city": destination, "check_in": iso["start"], "check_out": iso["end"]},
        "apartment": {"city": destination, "check_in": iso["start"], "check_out": iso["end"]},
        "restaurant": {"city": destination, "date": iso["dinner"], "meal": "dinner"},
        "rental_car": {"city": destination, "pick_up": iso["start"], "drop_off": iso["end"]},
    }
    phrases = {
        "flight": f"a one-way flight from {origin} to {destination} on {spoken['start']}",
        "hotel": f"a hotel in {destination} from {spoken['start']} to {spoken['end']}",
        "apartment": f"an apartment in {destination} from {spoken['start']} to {spoken['end']}",
        "restaurant": f"a restaurant for dinner in {destination} on {spoken['dinner']}",
        "rental_car": f"a rental car in {destination} from {spoken['start']} to {spoken['end']}",
    }
    wanted = [phrases[a] for a in aspects]
    listed = wanted[0] if len(wanted) == 1 else ", ".join(wanted[:-1]) + " and " + wanted[-1]
    return {
        "origin": origin,
        "destination": destination,
        "nights": nights,
        "dates": iso,
        "arguments": {a: arguments[a] for a in aspects},
        "description": f"I am planning a trip to {destination}. I need {listed}.",
    }


def _spoken(day: datetime.date) -> str:
    suffix = "th" if 11 <= day.day <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day.day % 10, "th")
    return f"{day:%B} {day.day}{suffix}"


def _new_option(rng: Rng, aspect: str, trip: dict[str, Any]) -> Option:
    args = trip["arguments"][aspect]
    if aspect == "flight":
        return new_flight(rng, args["origin"], args["destination"], args["date"])
    if aspect == "hotel":
        return new_hotel(rng, args["city"], args["check_in"], args["check_out"])
    if aspect == "apartment":
        return new_apartment(rng, args["city"], args["check_in"], args["check_out"])
    if aspect == "restaurant":
        return new_restaurant(rng, args["city"], args["date"])
    return new_car(rng, args["city"], args["pick_up"], args["drop_off"])


def matches_request(aspect: str, option: Option, arguments: dict[str, Any]) -> bool:
    """Whether an option is what the user asked to search for (route / city and dates / dinner)."""
    if aspect == "flight":
        return (option["path"][0], option["path"][-1], option["date"]) == (
            arguments["origin"],
            arguments["destination"],
            arguments["date"],
        )
    if aspect == "restaurant":
        return (
            option["city"] == arguments["city"] and option["date"] == arguments["date"] and "dinner" in option["meals"]
        )
    return all(option[k] == v for k, v in arguments.items())


def _mismatch(rng: Rng, aspect: str, option: Option) -> None:
    """Change one requested field so the option no longer matches the request (a noise option)."""
    other_city = rng.choice([c for c in CITIES if c not in (option.get("city"), *option.get("path", []))])
    shift = datetime.timedelta(days=rng.choice((-2, -1, 1, 2)))
    if aspect == "flight":
        if rng.random() < 0.5:
            option["date"] = (datetime.date.fromisoformat(option["date"]) + shift).isoformat()
        else:
            option["path"][-1] = other_city
    elif aspect == "restaurant":
        if rng.random() < 0.5:
            option["meals"] = ["lunch"]
        else:
            option["date"] = (datetime.date.fromisoformat(option["date"]) + shift).isoformat()
    elif rng.random() < 0.5:
        option["city"] = other_city
    else:
        field = "check_in" if aspect in ("hotel", "apartment") else "pick_up"
        option[field] = (datetime.date.fromisoformat(option[field]) + shift).isoformat()


def _options(
    rng: Rng, aspect: str, kinds: list[PreferenceKind], trip: dict[str, Any], wrong: int, noise: int
) -> tuple[list[Option], list[str], str]:
    ordered = sorted(range(len(kinds)), key=lambda i: kinds[i].order)

    def build(violate: set[int]) -> Option:
        option = _new_option(rng, aspect, trip)
        for i in ordered:
            kinds[i].apply(option, rng, i not in violate)
        if aspect == "flight":
            finish_flight(option, rng)
        return option

    n_correct = rng.randint(*CORRECT_OPTIONS)
    correct = [build(set()) for _ in range(n_correct)]
    wrong_options = [
        build(set(rng.sample(range(len(kinds)), rng.randint(1, min(2, len(kinds)))))) for _ in range(wrong)
    ]
    noise_options = []
    for _ in range(noise):
        option = build({i for i in range(len(kinds)) if rng.random() < 0.5})
        _mismatch(rng, aspect, option)
        noise_options.append(option)
    _price(rng, aspect, trip, correct, wrong_options + noise_options)
    args = trip["arguments"][aspect]
    for option in correct:
        assert matches_request(aspect, option, args) and all(k.check(option) for k in kinds), option
    for option in wrong_options:
        assert not all(k.check(option) for k in kinds), option
    for option in noise_options:
        assert not matches_request(aspect, option, args), option
    options = correct + wrong_options + noise_options
    rng.shuffle(options)
    ids = {id(o): f"{ASPECT_INITIALS[aspect]}{i}" for i, o in enumerate(options, 1)}
    best = min(correct, key=lambda o: o[COST_FIELD.get(aspect, "cost")])
    return [{"id": ids[id(o)], **o} for o in options], [ids[id(o)] for o in correct], ids[id(best)]


def _price(rng: Rng, aspect: str, trip: dict[str, Any], correct: list[Option], others: list[Option]) -> None:
    """Distinct prices for the correct options (so the best is unique); about half the others undercut the best."""
    low, high, step = PRICES[aspect]
    units = 1 if aspect in ("flight", "restaurant") else trip["nights"]
    field = COST_FIELD.get(aspect, "cost")
    grid = list(range(low + 10 * step, high + 1, step))
    for option, price in zip(correct, rng.sample(grid, len(correct)), strict=True):
        option[field] = price * units
    best = min(o[field] for o in correct) // units
    for option in others:
        cheaper = rng.random() < 0.5 and best - step >= low
        option[field] = (rng.randrange(low, best, step) if cheaper else rng.randrange(low, high + 1, step)) * units
