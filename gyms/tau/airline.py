"""The 14 tau-bench airline tools (SPEC.md §4), quirks included: the gold hashes depend on them.

Tables: `flights`, `reservations`, `users`. Seat counts never change; certificates and gift cards keep their
balance under `amount`; new reservations get the fixed ids HATHAT, HATHAU, HATHAV.
"""

import copy
import json
from typing import Any

from gyms.tau.store import EpisodeDB, Record, Table
from gyms.tau.toolkit import SHARED_TOOLS, ToolFn, tool, tool_table

# tau-bench's fixed answer of list_all_airports (not derived from the database).
AIRPORTS = {
    "SFO": "San Francisco",
    "JFK": "New York",
    "LAX": "Los Angeles",
    "ORD": "Chicago",
    "DFW": "Dallas",
    "DEN": "Denver",
    "SEA": "Seattle",
    "ATL": "Atlanta",
    "MIA": "Miami",
    "BOS": "Boston",
    "PHX": "Phoenix",
    "IAH": "Houston",
    "LAS": "Las Vegas",
    "MCO": "Orlando",
    "EWR": "Newark",
    "CLT": "Charlotte",
    "MSP": "Minneapolis",
    "DTW": "Detroit",
    "PHL": "Philadelphia",
    "LGA": "LaGuardia",
}
NEW_RESERVATION_IDS = ("HATHAT", "HATHAU", "HATHAV")
CERTIFICATE_IDS = ("certificate_3221322", "certificate_3221323", "certificate_3221324")
NOW = "2024-05-15T15:00:00"


@tool
def get_reservation_details(data: EpisodeDB, reservation_id: str) -> str:
    reservations = data["reservations"]
    if reservation_id not in reservations:
        return "Error: user not found"  # [quirk] the original's wording
    return json.dumps(reservations[reservation_id])


@tool
def list_all_airports(data: EpisodeDB) -> str:
    return json.dumps(AIRPORTS)


def _leg(flight: Record, day: Record) -> Record:
    """A flight without its calendar, merged with one day's record (status, seats, prices)."""
    leg = {k: v for k, v in flight.items() if k != "dates"}
    leg.update(day)
    return leg


@tool
def search_direct_flight(data: EpisodeDB, origin: str, destination: str, date: str) -> str:
    results = []
    for flight in data["flights"].values():
        if flight["origin"] == origin and flight["destination"] == destination:
            day = flight["dates"].get(date)
            if day is not None and day["status"] == "available":
                results.append(_leg(flight, day))
    return json.dumps(results)


@tool
def search_onestop_flight(data: EpisodeDB, origin: str, destination: str, date: str) -> str:
    flights = list(data["flights"].values())
    results = []
    for first in flights:
        if first["origin"] != origin:
            continue
        for second in flights:
            if second["destination"] != destination or second["origin"] != first["destination"]:
                continue
            second_date = date
            if "+1" in first["scheduled_arrival_time_est"]:  # [quirk] no zero padding, no month rollover
                second_date = "2024-05-" + str(int(date[-2:]) + 1)
            if first["scheduled_arrival_time_est"] > second["scheduled_departure_time_est"]:  # string comparison
                continue
            if date not in first["dates"] or second_date not in second["dates"]:
                continue
            if first["dates"][date]["status"] != "available" or second["dates"][second_date]["status"] != "available":
                continue
            leg1 = _leg(first, first["dates"][date])
            leg1["date"] = date
            leg2 = _leg(second, second["dates"][date])  # [quirk] the first leg's day, not second_date
            leg2["date"] = second_date
            results.append([leg1, leg2])
    return json.dumps(results)


def _price_segment(flights: Table, segment: Record, cabin: str, passengers: int) -> str | None:
    """Check a requested segment is bookable and store its price and route on it; an error string if not."""
    number = segment["flight_number"]
    if number not in flights:
        return f"Error: flight {number} not found"
    flight = flights[number]
    if segment["date"] not in flight["dates"]:
        return f"Error: flight {number} not found on date {segment['date']}"
    day = flight["dates"][segment["date"]]
    if day["status"] != "available":
        return f"Error: flight {number} not available on date {segment['date']}"
    if day["available_seats"][cabin] < passengers:
        return f"Error: not enough seats on flight {number}"
    segment["price"] = day["prices"][cabin]
    segment["origin"] = flight["origin"]
    segment["destination"] = flight["destination"]
    return None


@tool
def book_reservation(
    data: EpisodeDB,
    user_id: str,
    origin: str,
    destination: str,
    flight_type: str,
    cabin: str,
    flights: list[dict[str, Any]],
    passengers: list[dict[str, Any]],
    payment_methods: list[dict[str, Any]],
    total_baggages: int,
    nonfree_baggages: int,
    insurance: str,
) -> str:
    users, reservations = data["users"], data["reservations"]
    if user_id not in users:
        return "Error: user not found"
    reservation_id = next((r for r in NEW_RESERVATION_IDS[:-1] if r not in reservations), NEW_RESERVATION_IDS[-1])
    reservation: Record = {
        "reservation_id": reservation_id,
        "user_id": user_id,
        "origin": origin,
        "destination": destination,
        "flight_type": flight_type,
        "cabin": cabin,
        "flights": copy.deepcopy(flights),
        "passengers": passengers,
        "payment_history": payment_methods,
        "created_at": NOW,
        "total_baggages": total_baggages,
        "nonfree_baggages": nonfree_baggages,
        "insurance": insurance,
    }
    total = 0
    for segment in reservation["flights"]:
        error = _price_segment(data["flights"], segment, cabin, len(passengers))
        if error:
            return error
        total += segment["price"] * len(passengers)
    if insurance == "yes":
        total += 30 * len(passengers)
    total += 50 * nonfree_baggages

    methods = users[user_id]["payment_methods"]
    for payment in payment_methods:
        payment_id, amount = payment["payment_id"], payment["amount"]
        if payment_id not in methods:
            return f"Error: payment method {payment_id} not found"
        if methods[payment_id]["source"] in ("gift_card", "certificate") and methods[payment_id]["amount"] < amount:
            return f"Error: not enough balance in payment method {payment_id}"
    paid = sum(payment["amount"] for payment in payment_methods)
    if paid != total:
        return f"Error: payment amount does not add up, total price is {total}, but paid {paid}"

    user = users.edit(user_id)
    for payment in payment_methods:
        payment_id = payment["payment_id"]
        source = user["payment_methods"][payment_id]["source"]  # KeyError on a certificate listed twice [quirk]
        if source == "gift_card":
            user["payment_methods"][payment_id]["amount"] -= payment["amount"]
        elif source == "certificate":
            del user["payment_methods"][payment_id]  # any remainder is forfeited
    reservations.insert(reservation_id, reservation)
    user["reservations"].append(reservation_id)
    return json.dumps(reservation)


@tool
def cancel_reservation(data: EpisodeDB, reservation_id: str) -> str:
    reservations = data["reservations"]
    if reservation_id not in reservations:
        return "Error: reservation not found"
    reservation = reservations.edit(reservation_id)
    refunds = [{"payment_id": p["payment_id"], "amount": -p["amount"]} for p in reservation["payment_history"]]
    reservation["payment_history"].extend(refunds)
    reservation["status"] = "cancelled"
    return json.dumps(reservation)


def _payment_error(method: Record | None, amount: Any) -> str | None:
    """Checks shared by the baggage and flight updates."""
    if method is None:
        return "Error: payment method not found"
    if method["source"] == "certificate":
        return "Error: certificate cannot be used to update reservation"
    if method["source"] == "gift_card" and method["amount"] < amount:
        return "Error: gift card balance is not enough"
    return None


def _charge(data: EpisodeDB, reservation: Record, payment_id: str, amount: Any) -> None:
    """Take `amount` from a gift card (a negative amount refunds it) and record a non-zero payment."""
    user = data["users"][reservation["user_id"]]
    if user["payment_methods"][payment_id]["source"] == "gift_card":
        data["users"].edit(reservation["user_id"])["payment_methods"][payment_id]["amount"] -= amount
    if amount != 0:
        reservation["payment_history"].append({"payment_id": payment_id, "amount": amount})


@tool
def update_reservation_baggages(
    data: EpisodeDB, reservation_id: str, total_baggages: int, nonfree_baggages: int, payment_id: str
) -> str:
    reservations = data["reservations"]
    if reservation_id not in reservations:
        return "Error: reservation not found"
    reservation = reservations[reservation_id]
    fee = 50 * max(0, nonfree_baggages - reservation["nonfree_baggages"])
    methods = data["users"][reservation["user_id"]]["payment_methods"]
    error = _payment_error(methods.get(payment_id), fee)
    if error:
        return error
    reservation = reservations.edit(reservation_id)
    reservation["total_baggages"] = total_baggages
    reservation["nonfree_baggages"] = nonfree_baggages
    _charge(data, reservation, payment_id, fee)
    return json.dumps(reservation)


@tool
def update_reservation_flights(
    data: EpisodeDB, reservation_id: str, cabin: str, flights: list[dict[str, Any]], payment_id: str
) -> str:
    reservations = data["reservations"]
    if reservation_id not in reservations:
        return "Error: reservation not found"
    reservation = reservations[reservation_id]
    passengers = len(reservation["passengers"])
    new_flights = copy.deepcopy(flights)
    total = 0
    for segment in new_flights:
        kept = next(
            (
                old
                for old in reservation["flights"]
                if old["flight_number"] == segment["flight_number"]
                and old["date"] == segment["date"]
                and cabin == reservation["cabin"]
            ),
            None,
        )
        if kept is not None:  # unchanged segment in an unchanged cabin: old price, no availability check
            segment["price"] = kept["price"]
            segment["origin"] = kept["origin"]
            segment["destination"] = kept["destination"]
        else:
            error = _price_segment(data["flights"], segment, cabin, passengers)
            if error:
                return error
        total += segment["price"] * passengers
    total -= sum(old["price"] for old in reservation["flights"]) * passengers

    methods = data["users"][reservation["user_id"]]["payment_methods"]
    error = _payment_error(methods.get(payment_id), total)
    if error:
        return error
    reservation = reservations.edit(reservation_id)
    reservation["flights"] = new_flights  # [quirk] reservation["cabin"] is never updated
    _charge(data, reservation, payment_id, total)
    return json.dumps(reservation)


@tool
def update_reservation_passengers(data: EpisodeDB, reservation_id: str, passengers: list[dict[str, Any]]) -> str:
    reservations = data["reservations"]
    if reservation_id not in reservations:
        return "Error: reservation not found"
    if len(passengers) != len(reservations[reservation_id]["passengers"]):
        return "Error: number of passengers does not match"
    reservation = reservations.edit(reservation_id)
    reservation["passengers"] = passengers
    return json.dumps(reservation)


@tool
def send_certificate(data: EpisodeDB, user_id: str, amount: float) -> str:
    users = data["users"]
    if user_id not in users:
        return "Error: user not found"
    free = [c for c in CERTIFICATE_IDS if c not in users[user_id]["payment_methods"]]
    if not free:  # tau-bench returns None here and its step fails; MUA-RL's message instead
        return "Error: all certificate slots are already occupied for this user"
    users.edit(user_id)["payment_methods"][free[0]] = {"source": "certificate", "amount": amount, "id": free[0]}
    return f"Certificate {free[0]} added to user {user_id} with amount {amount}."


_OWN_TOOLS = (
    book_reservation,
    cancel_reservation,
    get_reservation_details,
    list_all_airports,
    search_direct_flight,
    search_onestop_flight,
    send_certificate,
    update_reservation_baggages,
    update_reservation_flights,
    update_reservation_passengers,
)
TOOLS: dict[str, ToolFn] = tool_table("airline", (*SHARED_TOOLS.values(), *_OWN_TOOLS))
TABLES = ("flights", "reservations", "users")
