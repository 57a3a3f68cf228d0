"""The world TravelGym scenarios are drawn from: cities, option factories and preference kinds per aspect.

A preference kind knows how to check an option and how to make an option satisfy or violate it, so the
generator can build correct options (satisfying every preference of the aspect) and wrong ones (violating at
least one) by construction. Kinds sharing a `key` exclude each other within one aspect.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Option = dict[str, Any]
Rng = random.Random

ASPECT_INITIALS = {"flight": "F", "hotel": "H", "apartment": "A", "restaurant": "R", "rental_car": "C"}
CITIES = (
    "New York", "San Francisco", "Los Angeles", "Chicago", "Seattle", "Boston", "Miami", "Austin", "Denver",
    "London", "Paris", "Rome", "Barcelona", "Amsterdam", "Berlin", "Tokyo", "Seoul", "Singapore", "Sydney",
    "Toronto",
)  # fmt: skip
HUBS = ("Dallas", "Atlanta", "Frankfurt", "Istanbul", "Dubai", "Doha", "Munich", "Zurich")
AIRLINES = {"Delta": "DL", "United": "UA", "American": "AA", "Lufthansa": "LH", "Emirates": "EK", "JetBlue": "B6"}
FLIGHT_AMENITIES = ("Wi-Fi", "in-seat power", "a meal", "seatback entertainment")
HOTEL_NAMES = ("Grand", "Plaza", "Harbor", "Park", "Royal", "Central", "Garden", "Crown", "Summit", "Riverside")
HOTEL_KINDS = ("Hotel", "Inn", "Suites", "Resort", "Lodge")
HOTEL_AMENITIES = ("free breakfast", "a pool", "a fitness center", "free parking", "a spa")
ROOMS = ("standard queen room", "king room", "two double beds room", "junior suite")
APARTMENT_AMENITIES = ("a washer", "a full kitchen", "a balcony", "a dedicated workspace", "free parking")
APARTMENT_NAMES = ("Loft", "Residence", "Flat", "Studios", "Apartments", "Home")
CUISINES = ("Italian", "Japanese", "Mexican", "Indian", "Thai", "French", "Greek", "Korean")
RESTAURANT_TAGS = ("vegetarian options", "outdoor seating", "quiet atmosphere", "kid-friendly", "live music")
RESTAURANT_WORDS = ("Bistro", "Kitchen", "Table", "House", "Garden", "Corner", "Tavern", "Cellar")
CAR_COMPANIES = ("Hertz", "Avis", "Enterprise", "Budget", "Sixt")
CARS = {  # category: (model, seats, how the user names it)
    "compact": ("Toyota Corolla", 5, "a compact car"),
    "sedan": ("Honda Accord", 5, "a sedan"),
    "SUV": ("Toyota RAV4", 5, "an SUV"),
    "minivan": ("Honda Odyssey", 7, "a minivan"),
    "electric": ("Tesla Model 3", 5, "an electric car"),
    "convertible": ("Ford Mustang Convertible", 4, "a convertible"),
}


@dataclass(frozen=True)
class PreferenceKind:
    """One hidden preference: its texts for the user simulator, and how options satisfy it."""

    key: str  # kinds with the same key exclude each other
    subcategory: str
    text: str  # the preference, stated plainly (for the judges)
    implicit: str  # how the user hints at it (guides the simulator's reply)
    check: Callable[[Option], bool]
    apply: Callable[[Option, Rng, bool], None]  # make the option satisfy (True) or violate (False) it
    order: int = 0  # kinds that rebuild an option's structure apply first


def _contains(field: str, value: str) -> tuple[Callable[[Option], bool], Callable[[Option, Rng, bool], None]]:
    def check(o: Option) -> bool:
        return value in o[field]

    def apply(o: Option, rng: Rng, ok: bool) -> None:
        items = [x for x in o[field] if x != value]
        if ok:
            items.insert(rng.randint(0, len(items)), value)
        o[field] = items

    return check, apply


def _at_least(field: str, threshold: float, low: float, high: float, digits: int = 1) -> tuple[Any, Any]:
    def check(o: Option) -> bool:
        return o[field] >= threshold

    def apply(o: Option, rng: Rng, ok: bool) -> None:
        o[field] = (
            round(rng.uniform(threshold, high), digits) if ok else round(rng.uniform(low, threshold - 0.3), digits)
        )

    return check, apply


def _at_most(field: str, threshold: float, low: float, high: float) -> tuple[Any, Any]:
    def check(o: Option) -> bool:
        return o[field] <= threshold

    def apply(o: Option, rng: Rng, ok: bool) -> None:
        o[field] = round(rng.uniform(low, threshold), 1) if ok else round(rng.uniform(threshold + 0.5, high), 1)

    return check, apply


def _equals(field: str, value: Any, others: tuple[Any, ...]) -> tuple[Any, Any]:
    def check(o: Option) -> bool:
        return o[field] == value

    def apply(o: Option, rng: Rng, ok: bool) -> None:
        o[field] = value if ok else rng.choice([x for x in others if x != value])

    return check, apply


def _free(service: str, low: int, high: int) -> tuple[Any, Any]:
    def check(o: Option) -> bool:
        return o["service"].get(service) == 0

    def apply(o: Option, rng: Rng, ok: bool) -> None:
        o["service"][service] = 0 if ok else rng.randint(low, high)

    return check, apply


def _kind(key: str, sub: str, text: str, implicit: str, rule: tuple[Any, Any], order: int = 0) -> PreferenceKind:
    return PreferenceKind(key, sub, text, implicit, rule[0], rule[1], order)


# ---------------------------------------------------------------------------------------------------- flights


def _direct(o: Option) -> bool:
    return len(o["path"]) == 2


def _set_stops(o: Option, rng: Rng, direct: bool) -> None:
    origin, destination = o["path"][0], o["path"][-1]
    airline = o["company"][0]
    if direct:
        o["path"], o["time"], o["company"] = [origin, destination], [round(rng.uniform(2, 9), 1)], [airline]
    else:
        hub = rng.choice(HUBS)
        legs = [round(rng.uniform(1.5, 6), 1), round(rng.uniform(1, 4), 1), round(rng.uniform(1.5, 7), 1)]
        o["path"], o["time"], o["company"] = [origin, hub, destination], legs, [airline, airline]


def _airline(name: str) -> tuple[Any, Any]:
    def check(o: Option) -> bool:
        return all(c == name for c in o["company"])

    def apply(o: Option, rng: Rng, ok: bool) -> None:
        others = [a for a in AIRLINES if a != name]
        o["company"] = [name if ok else rng.choice(others) for _ in o["company"]]

    return check, apply


def _morning(morning: bool) -> tuple[Any, Any]:
    def check(o: Option) -> bool:
        return (int(o["departure"][:2]) < 12) == morning

    def apply(o: Option, rng: Rng, ok: bool) -> None:
        hour = rng.randint(6, 11) if ok == morning else rng.randint(13, 21)
        o["departure"] = f"{hour:02d}:{rng.choice((0, 15, 30, 45)):02d}"

    return check, apply


def flight_kinds(rng: Rng) -> list[PreferenceKind]:
    airline = rng.choice(list(AIRLINES))
    amenity = rng.choice(FLIGHT_AMENITIES)
    morning = rng.random() < 0.5
    when = "in the morning" if morning else "in the afternoon or evening"
    return [
        _kind(
            "stops",
            "layovers",
            "Wants a direct flight with no layovers.",
            "Changing planes wears me out; I'd rather just board once and get there.",
            (_direct, _set_stops),
            order=-1,
        ),
        _kind(
            "airline",
            "airline",
            f"Wants to fly {airline} on every leg.",
            f"I collect miles with {airline} and don't want to split them with another carrier.",
            _airline(airline),
        ),
        _kind(
            f"amenity:{amenity}",
            "amenities",
            f"Wants {amenity} on board, free of charge.",
            f"I really can't do without {amenity} during a flight.",
            _contains("amenities", amenity),
        ),
        _kind(
            "bag",
            "baggage",
            "Wants a checked bag included at no extra cost.",
            "I'm bringing a big suitcase and I hate paying baggage fees on top of the fare.",
            _free("checked bag", 25, 70),
        ),
        _kind(
            "departure",
            "departure time",
            f"Wants to depart {when}.",
            "I'm an early bird, I like to get going right after sunrise."
            if morning
            else "Mornings are rough for me, I'd rather leave after lunch.",
            _morning(morning),
        ),
    ]


def new_flight(rng: Rng, origin: str, destination: str, date: str) -> Option:
    option = {
        "path": [origin, destination],
        "time": [round(rng.uniform(2, 9), 1)],
        "company": [rng.choice(list(AIRLINES))],
        "flight_number": [],
        "date": date,
        "departure": f"{rng.randint(6, 21):02d}:{rng.choice((0, 15, 30, 45)):02d}",
        "cost": 0,
        "amenities": rng.sample(FLIGHT_AMENITIES, rng.randint(0, 3)),
        "service": {"checked bag": rng.choice((0, 30, 35, 45)), "seat selection": rng.choice((0, 15, 25))},
    }
    _set_stops(option, rng, rng.random() < 0.5)
    return option


def finish_flight(o: Option, rng: Rng) -> None:
    """Flight numbers follow the final airlines; the fare is set by the generator."""
    o["flight_number"] = [f"{AIRLINES[c]}{rng.randint(100, 2999)}" for c in o["company"]]


# ----------------------------------------------------------------------------------------------- hotels etc.


def hotel_kinds(rng: Rng) -> list[PreferenceKind]:
    amenity = rng.choice(HOTEL_AMENITIES)
    room = rng.choice(ROOMS)
    rating = rng.choice((8.0, 8.5, 9.0))
    km = rng.choice((1.0, 2.0, 3.0))
    return [
        _kind(
            "rating",
            "rating",
            f"Wants a hotel rated at least {rating} out of 10.",
            "I've been burned by poorly reviewed places before; I only trust hotels guests really love.",
            _at_least("rating", rating, 5.0, 9.8),
        ),
        _kind(
            f"amenity:{amenity}",
            "amenities",
            f"Wants {amenity} at the hotel.",
            f"A stay just doesn't feel complete for me without {amenity}.",
            _contains("amenities", amenity),
        ),
        _kind(
            "room",
            "room type",
            f"Wants a {room}.",
            f"I always sleep best in a {room}, it's what I book at home too.",
            _equals("room", room, ROOMS),
        ),
        _kind(
            "distance",
            "location",
            f"Wants the hotel within {km} km of the city center.",
            "I want to walk everywhere in the evening, not spend my time on buses from the outskirts.",
            _at_most("distance_to_center_km", km, 0.2, 12.0),
        ),
        _kind(
            "shuttle",
            "services",
            "Wants a free airport shuttle.",
            "Getting from the airport is always a hassle; it would be great if the hotel picked me up for free.",
            _free("airport shuttle", 15, 40),
        ),
    ]


def new_hotel(rng: Rng, city: str, check_in: str, check_out: str) -> Option:
    return {
        "name": f"{rng.choice(HOTEL_NAMES)} {city} {rng.choice(HOTEL_KINDS)}",
        "city": city,
        "check_in": check_in,
        "check_out": check_out,
        "room": rng.choice(ROOMS),
        "cost": 0,
        "rating": round(rng.uniform(6.0, 9.8), 1),
        "distance_to_center_km": round(rng.uniform(0.2, 12.0), 1),
        "amenities": rng.sample(HOTEL_AMENITIES, rng.randint(1, 3)),
        "service": {"airport shuttle": rng.choice((0, 20, 30)), "late checkout": rng.choice((0, 25, 40))},
    }


def apartment_kinds(rng: Rng) -> list[PreferenceKind]:
    amenity = rng.choice(APARTMENT_AMENITIES)
    bedrooms = rng.choice((2, 3))
    rating = rng.choice((8.0, 8.5, 9.0))

    def beds(o: Option) -> bool:
        return int(o["room"][0]) >= bedrooms

    def set_beds(o: Option, r: Rng, ok: bool) -> None:
        n = r.randint(bedrooms, 4) if ok else r.randint(1, bedrooms - 1)
        o["room"], o["capacity"] = f"{n}B{r.randint(1, n)}B", 2 * n

    return [
        _kind(
            "bedrooms",
            "rooms",
            f"Wants at least {bedrooms} bedrooms.",
            "We're a few people and everyone needs their own room to sleep well.",
            (beds, set_beds),
        ),
        _kind(
            f"amenity:{amenity}",
            "amenities",
            f"Wants an apartment with {amenity}.",
            f"For a longer stay I really rely on having {amenity}.",
            _contains("amenities", amenity),
        ),
        _kind(
            "rating",
            "rating",
            f"Wants an apartment rated at least {rating} out of 10.",
            "I only book places other guests rave about.",
            _at_least("rating", rating, 5.0, 9.8),
        ),
        _kind(
            "cleaning",
            "services",
            "Wants the cleaning fee included (no extra charge).",
            "Those surprise cleaning fees at checkout drive me crazy.",
            _free("cleaning", 40, 120),
        ),
        _kind(
            "pets",
            "pets",
            "Travels with a dog: pets must be allowed.",
            "My dog goes everywhere with me, she's part of the family.",
            _equals("pets_allowed", True, (True, False)),
        ),
    ]


def new_apartment(rng: Rng, city: str, check_in: str, check_out: str) -> Option:
    n = rng.randint(1, 4)
    return {
        "name": f"{city} {rng.choice(HOTEL_NAMES)} {rng.choice(APARTMENT_NAMES)}",
        "city": city,
        "check_in": check_in,
        "check_out": check_out,
        "room": f"{n}B{rng.randint(1, n)}B",
        "capacity": 2 * n,
        "cost": 0,
        "rating": round(rng.uniform(6.0, 9.8), 1),
        "pets_allowed": rng.random() < 0.4,
        "amenities": rng.sample(APARTMENT_AMENITIES, rng.randint(1, 3)),
        "service": {"cleaning": rng.choice((0, 50, 80))},
    }


def restaurant_kinds(rng: Rng) -> list[PreferenceKind]:
    cuisine = rng.choice(CUISINES)
    tags = rng.sample(RESTAURANT_TAGS, 2)
    rating = rng.choice((8.0, 8.5))
    return [
        _kind(
            "cuisine",
            "cuisine",
            f"Wants {cuisine} food.",
            f"I've been craving {cuisine} food for weeks now.",
            _equals("cuisine", cuisine, CUISINES),
        ),
        _kind(
            "rating",
            "rating",
            f"Wants a restaurant rated at least {rating} out of 10.",
            "I only have one dinner there, so it has to be a place people truly love.",
            _at_least("rating", rating, 5.0, 9.8),
        ),
        *(
            _kind(
                f"tag:{tag}",
                "atmosphere",
                f"Wants a restaurant with {tag}.",
                f"For this dinner, {tag} would make all the difference to me.",
                _contains("tags", tag),
            )
            for tag in tags
        ),
    ]


def new_restaurant(rng: Rng, city: str, date: str) -> Option:
    return {
        "name": f"{rng.choice(HOTEL_NAMES)} {rng.choice(RESTAURANT_WORDS)}",
        "city": city,
        "date": date,
        "meals": ["lunch", "dinner"],
        "cuisine": rng.choice(CUISINES),
        "price_per_person": 0,
        "rating": round(rng.uniform(6.0, 9.8), 1),
        "tags": rng.sample(RESTAURANT_TAGS, rng.randint(1, 3)),
    }


def car_kinds(rng: Rng) -> list[PreferenceKind]:
    category = rng.choice(list(CARS))
    company = rng.choice(CAR_COMPANIES)

    def set_category(o: Option, r: Rng, ok: bool) -> None:
        o["category"] = category if ok else r.choice([c for c in CARS if c != category])
        o["model"], o["seats"], _ = CARS[o["category"]]

    return [
        _kind(
            "category",
            "vehicle type",
            f"Wants {CARS[category][2]}.",
            f"I've driven {CARS[category][2]} for years, it's the only kind of car I feel comfortable in.",
            (lambda o: o["category"] == category, set_category),
            order=-1,
        ),
        _kind(
            "company",
            "rental company",
            f"Wants to rent from {company}.",
            f"I have a loyalty card with {company}, and they've always treated me well.",
            _equals("company", company, CAR_COMPANIES),
        ),
        _kind(
            "insurance",
            "insurance",
            "Wants full insurance coverage included at no extra cost.",
            "I don't want to worry about a single scratch on a rental.",
            _free("full insurance", 15, 45),
        ),
        _kind(
            "transmission",
            "transmission",
            "Wants an automatic transmission.",
            "I never learned to drive stick.",
            _equals("transmission", "automatic", ("automatic", "manual")),
        ),
        _kind(
            "mileage",
            "services",
            "Wants unlimited mileage included.",
            "I plan some long drives and don't want to count kilometres.",
            _free("unlimited mileage", 10, 30),
        ),
    ]


def new_car(rng: Rng, city: str, pick_up: str, drop_off: str) -> Option:
    category = rng.choice(list(CARS))
    return {
        "company": rng.choice(CAR_COMPANIES),
        "model": CARS[category][0],
        "category": category,
        "seats": CARS[category][1],
        "transmission": rng.choice(("automatic", "manual")),
        "city": city,
        "pick_up": pick_up,
        "drop_off": drop_off,
        "cost": 0,
        "service": {"full insurance": rng.choice((0, 20, 30)), "unlimited mileage": rng.choice((0, 15))},
    }


PREFERENCE_KINDS: dict[str, Callable[[Rng], list[PreferenceKind]]] = {
    "flight": flight_kinds,
    "hotel": hotel_kinds,
    "apartment": apartment_kinds,
    "restaurant": restaurant_kinds,
    "rental_car": car_kinds,
}

# What the agent is told about the fields of each aspect's options.
# The option schema shown with search results, in UserRL's layout and wording; the fields are the generator's
# (UserRL's scenario files are not public), so some differ from UserRL's (gyms/README.md).
OPTION_SCHEMAS = {
    "flight": """Each flight option includes:
    - path: Array of airport/city names from origin to destination, including layovers
    - time: Flight and layover durations in hours (alternating: flight, layover, flight, etc.)
    - company: Airline names for each leg of the trip
    - flight_number: Flight numbers corresponding to each airline leg
    - date: Departure date
    - departure: Local departure time
    - cost: Total ticket price in USD for economy class
    - amenities: Available in-flight amenities free of charge
    - service: Additional services with costs""",
    "hotel": """Each hotel option includes:
    - name: Hotel name
    - city: City of the hotel
    - check_in: Check-in date
    - check_out: Check-out date
    - room: Room type
    - cost: Cost of the room for the entire stay in USD
    - rating: Hotel rating on a scale of 0-10
    - distance_to_center_km: Distance to the city center in kilometers
    - amenities: Available facilities free of charge
    - service: Additional services with costs""",
    "restaurant": """Each restaurant option includes:
    - name: Restaurant name
    - city: City of the restaurant
    - date: Date of the reservation
    - meals: Meals served
    - cuisine: Type of cuisine
    - price_per_person: Average price per person in USD
    - rating: Average restaurant rating on a scale of 0-10
    - tags: Descriptive features""",
    "apartment": """Each apartment rental option includes:
    - name: Apartment listing name or brand
    - city: City of the apartment
    - check_in: Check-in date
    - check_out: Check-out date
    - room: Room configuration using bedroom/bathroom format (e.g. 1B1B, 2B1B, 3B2B)
    - capacity: Maximum number of guests the apartment can accommodate
    - cost: Total rental cost for the entire stay in USD
    - rating: Apartment rating on a scale of 0-10
    - pets_allowed: Whether pets are allowed
    - amenities: Available facilities free of charge
    - service: Additional services with costs""",
    "rental_car": """Each rental car option includes:
    - company: Car rental company name
    - model: Specific car model
    - category: Vehicle category
    - seats: Number of passenger seats
    - transmission: Transmission type (automatic or manual)
    - city: City of pick-up and drop-off
    - pick_up: Pick-up date
    - drop_off: Drop-off date
    - cost: Total rental cost for the entire period in USD
    - service: Additional services with costs""",
}
