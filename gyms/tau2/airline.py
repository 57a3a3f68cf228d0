"""tau2's airline domain (SPEC.md §3.1, §4): the dump shape of its records and its 14 tools, quirks included.

Tables `flights`, `users`, `reservations`. Tools read and write dump-shaped records (`normalise`), so observations
are `json.dumps(record)` and the hash is upstream's.
"""

from typing import Any

from gyms.tau.store import Record
from gyms.tau2.store import Tau2DB
from gyms.tau2.toolkit import ToolFn, calculate, toolkit, transfer_to_human_agents

TABLES = ("flights", "users", "reservations")
AIRPORTS = (
    ("SFO", "San Francisco"), ("JFK", "New York"), ("LAX", "Los Angeles"), ("ORD", "Chicago"), ("DFW", "Dallas"),
    ("DEN", "Denver"), ("SEA", "Seattle"), ("ATL", "Atlanta"), ("MIA", "Miami"), ("BOS", "Boston"),
    ("PHX", "Phoenix"), ("IAH", "Houston"), ("LAS", "Las Vegas"), ("MCO", "Orlando"), ("EWR", "Newark"),
    ("CLT", "Charlotte"), ("MSP", "Minneapolis"), ("DTW", "Detroit"), ("PHL", "Philadelphia"), ("LGA", "LaGuardia"),
)  # fmt: skip
NEW_RESERVATION_IDS = ("HATHAT", "HATHAU", "HATHAV")
CERTIFICATE_IDS = ("certificate_3221322", "certificate_3221323", "certificate_3221324")
NOW = "2024-05-15T15:00:00"
STATUS_FIELDS = {
    "available": ("available_seats", "prices"),
    "on time": ("estimated_departure_time_est", "estimated_arrival_time_est"),
    "flying": ("actual_departure_time_est", "estimated_arrival_time_est"),
    "landed": ("actual_departure_time_est", "actual_arrival_time_est"),
    "cancelled": (),
    "delayed": ("estimated_departure_time_est", "estimated_arrival_time_est"),
}
FLIGHT = ("flight_number", "origin", "destination")


def _pick(raw: Record, fields: tuple[str, ...]) -> Record:
    return {f: raw.get(f) for f in fields}


def _passenger(raw: Record) -> Record:
    return _pick(raw, ("first_name", "last_name", "dob"))


def _payment(raw: Record) -> Record:
    return {"payment_id": raw["payment_id"], "amount": int(raw["amount"])}


def _method(raw: Record) -> Record:
    if raw["source"] == "credit_card":
        return _pick(raw, ("source", "id", "brand", "last_four"))
    return {"source": raw["source"], "id": raw["id"], "amount": float(raw["amount"])}


def normalise(table: str, raw: Record) -> Record:
    """A record of `table` as upstream's model dumps it: every field, in field order, floats where declared."""
    if table == "flights":
        dates = {d: {"status": s["status"], **_pick(s, STATUS_FIELDS[s["status"]])} for d, s in raw["dates"].items()}
        return {**_pick(raw, (*FLIGHT, "scheduled_departure_time_est", "scheduled_arrival_time_est")), "dates": dates}
    if table == "users":
        address = _pick(raw["address"], ("address1", "address2", "city", "country", "state", "zip"))
        return {
            **_pick(raw, ("user_id", "name", "address", "email", "dob")),
            "name": _pick(raw["name"], ("first_name", "last_name")),
            "address": address,
            "payment_methods": {k: _method(m) for k, m in raw["payment_methods"].items()},
            "saved_passengers": [_passenger(p) for p in raw["saved_passengers"]],
            "membership": raw["membership"],
            "reservations": list(raw["reservations"]),
        }
    fields = ("reservation_id", "user_id", "origin", "destination", "flight_type", "cabin")
    return {
        **_pick(raw, fields),
        "flights": [{**_pick(f, (*FLIGHT, "date")), "price": int(f["price"])} for f in raw["flights"]],
        "passengers": [_passenger(p) for p in raw["passengers"]],
        "payment_history": [_payment(p) for p in raw["payment_history"]],
        **_pick(raw, ("created_at", "total_baggages", "nonfree_baggages", "insurance", "status")),
    }


def _user(db: Tau2DB, user_id: str) -> Record:
    if user_id not in db["users"]:
        raise ValueError(f"User {user_id} not found")
    return db["users"][user_id]


def _reservation(db: Tau2DB, reservation_id: str) -> Record:
    if reservation_id not in db["reservations"]:
        raise ValueError(f"Reservation {reservation_id} not found")
    return db["reservations"][reservation_id]


def _flight(db: Tau2DB, flight_number: str) -> Record:
    if flight_number not in db["flights"]:
        raise ValueError(f"Flight {flight_number} not found")
    return db["flights"][flight_number]


def _instance(db: Tau2DB, flight_number: str, date: str) -> Record:
    flight = _flight(db, flight_number)
    if date not in flight["dates"]:
        raise ValueError(f"Flight {flight_number} not found on date {date}")
    return flight["dates"][date]


def _flight_info(raw: Any) -> Record:
    """pydantic's FlightInfo(**raw): both fields required."""
    missing = [f for f in ("flight_number", "date") if f not in raw]
    if missing:
        raise ValueError(f"{len(missing)} validation error{'s' if len(missing) > 1 else ''} for FlightInfo")
    return {"flight_number": raw["flight_number"], "date": raw["date"]}


def _direct(db: Tau2DB, date: str, origin: str | None, destination: str | None, after: str | None) -> list[Record]:
    out = []
    for flight in db["flights"].values():
        day = flight["dates"].get(date)
        if (
            (origin is None or flight["origin"] == origin)
            and (destination is None or flight["destination"] == destination)
            and day is not None
            and day["status"] == "available"
            and (after is None or flight["scheduled_departure_time_est"] >= after)
        ):
            out.append(
                {
                    **_pick(flight, FLIGHT),
                    "status": "available",
                    **_pick(flight, ("scheduled_departure_time_est", "scheduled_arrival_time_est")),
                    "date": None,
                    "available_seats": dict(day["available_seats"]),
                    "prices": dict(day["prices"]),
                }
            )
    return out


def get_user_details(db: Tau2DB, user_id: str) -> Record:
    return _user(db, user_id)


def get_reservation_details(db: Tau2DB, reservation_id: str) -> Record:
    return _reservation(db, reservation_id)


def get_flight_status(db: Tau2DB, flight_number: str, date: str) -> str:
    return str(_instance(db, flight_number, date)["status"])


def list_all_airports(db: Tau2DB) -> list[Record]:
    return [{"iata": iata, "city": city} for iata, city in AIRPORTS]


def search_direct_flight(db: Tau2DB, origin: str, destination: str, date: str) -> list[Record]:
    return _direct(db, date, origin, destination, None)


def search_onestop_flight(db: Tau2DB, origin: str, destination: str, date: str) -> list[list[Record]]:
    """[quirk] the next-day date is not zero-padded (`2024-05-6`)."""
    out = []
    for first in _direct(db, date, origin, None, None):
        first["date"] = date
        date2 = f"2024-05-{int(date[-2:]) + 1}" if "+1" in first["scheduled_arrival_time_est"] else date
        for second in _direct(db, date2, first["destination"], destination, first["scheduled_arrival_time_est"]):
            second["date"] = date2
            out.append([first, second])
    return out


def _pay_update(db: Tau2DB, user_id: str, payment_id: str, total: int) -> Record | None:
    """§4.4: checks, gift-card deduction, and the payment record (None when the total is 0)."""
    user = db["users"][user_id]
    if payment_id not in user["payment_methods"]:
        raise ValueError("Payment method not found")
    method = user["payment_methods"][payment_id]
    if method["source"] == "certificate":
        raise ValueError("Certificate cannot be used to update reservation")
    if method["source"] == "gift_card" and method["amount"] < total:
        raise ValueError("Gift card balance is not enough")
    if method["source"] == "gift_card":
        db["users"].edit(user_id)["payment_methods"][payment_id]["amount"] -= total
    return {"payment_id": payment_id, "amount": int(total)} if total != 0 else None


def book_reservation(
    db: Tau2DB,
    user_id: str,
    origin: str,
    destination: str,
    flight_type: str,
    cabin: str,
    flights: list[Any],
    passengers: list[Any],
    payment_methods: list[Any],
    total_baggages: int,
    nonfree_baggages: int,
    insurance: str,
) -> Record:
    """§4.2, in upstream's order of checks; nothing is written before every check passed."""
    if all(isinstance(f, dict) for f in flights):
        flights = [_flight_info(f) for f in flights]
    if all(isinstance(p, dict) for p in passengers):
        passengers = [_passenger(p) for p in passengers]
    if all(isinstance(p, dict) for p in payment_methods):
        payment_methods = [_payment(p) for p in payment_methods]
    user = _user(db, user_id)
    new_id = next((i for i in NEW_RESERVATION_IDS if i not in db["reservations"]), None)
    if new_id is None:
        raise ValueError("Too many reservations")
    for field, value, allowed in (
        ("flight_type", flight_type, ("round_trip", "one_way")),
        ("cabin", cabin, ("business", "economy", "basic_economy")),
        ("insurance", insurance, ("yes", "no")),
    ):
        if value not in allowed:
            raise ValueError(f"1 validation error for Reservation\n{field}")
    segments, total = [], 0
    for info in flights:
        flight = _flight(db, info["flight_number"])
        day = _instance(db, info["flight_number"], info["date"])
        if day["status"] != "available":
            raise ValueError(f"Flight {info['flight_number']} not available on date {info['date']}")
        if day["available_seats"][cabin] < len(passengers):
            raise ValueError(f"Not enough seats on flight {info['flight_number']}")
        price = day["prices"][cabin]
        segments.append({**_pick(flight, FLIGHT), "date": info["date"], "price": price})
        total += price * len(passengers)
    if insurance == "yes":
        total += 30 * len(passengers)
    total += 50 * nonfree_baggages
    for payment in payment_methods:
        pid = payment["payment_id"]
        if pid not in user["payment_methods"]:
            raise ValueError(f"Payment method {pid} not found")
        method = user["payment_methods"][pid]
        if method["source"] in ("gift_card", "certificate") and method["amount"] < payment["amount"]:
            raise ValueError(f"Not enough balance in payment method {pid}")
    paid = sum(p["amount"] for p in payment_methods)
    if paid != total:
        raise ValueError(f"Payment amount does not add up, total price is {total}, but paid {paid}")
    owner = db["users"].edit(user_id)
    for payment in payment_methods:
        method = owner["payment_methods"][payment["payment_id"]]
        if method["source"] == "gift_card":
            method["amount"] -= payment["amount"]
        elif method["source"] == "certificate":
            owner["payment_methods"].pop(payment["payment_id"])  # [quirk] consumed whole
    for info in flights:
        db["flights"].edit(info["flight_number"])["dates"][info["date"]]["available_seats"][cabin] -= len(passengers)
    reservation = {
        "reservation_id": new_id,
        "user_id": user_id,
        "origin": origin,
        "destination": destination,
        "flight_type": flight_type,
        "cabin": cabin,
        "flights": segments,
        "passengers": [dict(p) for p in passengers],
        "payment_history": [dict(p) for p in payment_methods],
        "created_at": NOW,
        "total_baggages": total_baggages,
        "nonfree_baggages": nonfree_baggages,
        "insurance": insurance,
        "status": None,
    }
    db["reservations"].insert(new_id, reservation)
    owner["reservations"].append(new_id)
    return reservation


def cancel_reservation(db: Tau2DB, reservation_id: str) -> Record:
    """[quirk] refunds every history entry, refunds included; releases nothing."""
    _reservation(db, reservation_id)
    reservation = db["reservations"].edit(reservation_id)
    refunds = [{"payment_id": p["payment_id"], "amount": -p["amount"]} for p in reservation["payment_history"]]
    reservation["payment_history"].extend(refunds)
    reservation["status"] = "cancelled"
    return reservation


def send_certificate(db: Tau2DB, user_id: str, amount: int) -> str:
    user = _user(db, user_id)
    for cid in CERTIFICATE_IDS:
        if cid not in user["payment_methods"]:
            certificate = {"source": "certificate", "id": cid, "amount": float(amount)}
            db["users"].edit(user_id)["payment_methods"][cid] = certificate
            return f"Certificate {cid} added to user {user_id} with amount {amount}."
    raise ValueError("Too many certificates")


def update_reservation_baggages(
    db: Tau2DB, reservation_id: str, total_baggages: int, nonfree_baggages: int, payment_id: str
) -> Record:
    """[quirk] the payment method is checked even at zero cost; the counts are stored as given."""
    reservation = _reservation(db, reservation_id)
    _user(db, reservation["user_id"])
    price = 50 * max(0, nonfree_baggages - reservation["nonfree_baggages"])
    payment = _pay_update(db, reservation["user_id"], payment_id, price)
    reservation = db["reservations"].edit(reservation_id)
    if payment is not None:
        reservation["payment_history"].append(payment)
    reservation["total_baggages"] = total_baggages
    reservation["nonfree_baggages"] = nonfree_baggages
    return reservation


def update_reservation_flights(
    db: Tau2DB, reservation_id: str, cabin: str, flights: list[Any], payment_id: str
) -> Record:
    """§4.3: kept segments keep their price; seat inventory is not touched."""
    if all(isinstance(f, dict) for f in flights):
        flights = [_flight_info(f) for f in flights]
    reservation = _reservation(db, reservation_id)
    _user(db, reservation["user_id"])
    count = len(reservation["passengers"])
    total, segments = 0, []
    for info in flights:
        kept = next(
            (
                s
                for s in reservation["flights"]
                if s["flight_number"] == info["flight_number"]
                and s["date"] == info["date"]
                and cabin == reservation["cabin"]
            ),
            None,
        )
        if kept is not None:
            total += kept["price"] * count
            segments.append(dict(kept))
            continue
        flight = _flight(db, info["flight_number"])
        day = _instance(db, info["flight_number"], info["date"])
        if day["status"] != "available":
            raise ValueError(f"Flight {info['flight_number']} not available on date {info['date']}")
        if day["available_seats"][cabin] < count:
            raise ValueError(f"Not enough seats on flight {info['flight_number']}")
        segment = {**_pick(flight, FLIGHT), "date": info["date"], "price": day["prices"][cabin]}
        total += segment["price"] * count
        segments.append(segment)
    total -= sum(s["price"] for s in reservation["flights"]) * count
    payment = _pay_update(db, reservation["user_id"], payment_id, total)
    reservation = db["reservations"].edit(reservation_id)
    if payment is not None:
        reservation["payment_history"].append(payment)
    reservation["flights"] = segments
    reservation["cabin"] = cabin
    return reservation


def update_reservation_passengers(db: Tau2DB, reservation_id: str, passengers: list[Any]) -> Record:
    if all(isinstance(p, dict) for p in passengers):
        passengers = [_passenger(p) for p in passengers]
    reservation = _reservation(db, reservation_id)
    if len(passengers) != len(reservation["passengers"]):
        raise ValueError("Number of passengers does not match")
    reservation = db["reservations"].edit(reservation_id)
    reservation["passengers"] = [dict(p) for p in passengers]
    return reservation


TOOLS: dict[str, ToolFn] = toolkit(
    "AirlineTools",
    (
        book_reservation, calculate, cancel_reservation, get_reservation_details, get_user_details,
        list_all_airports, search_direct_flight, search_onestop_flight, send_certificate,
        transfer_to_human_agents, update_reservation_baggages, update_reservation_flights,
        update_reservation_passengers, get_flight_status,
    ),
)  # fmt: skip
WRITE_TOOLS = frozenset(
    {
        "book_reservation", "cancel_reservation", "send_certificate", "update_reservation_baggages",
        "update_reservation_flights", "update_reservation_passengers",
    }
)  # fmt: skip
