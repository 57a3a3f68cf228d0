"""The user's phone in tau2's telecom domain (SPEC.md §3.4, §7.3): its state logic, the 30 phone tools the
simulated user calls, and the helpers tasks use to set it up, break it and assert on it."""

from typing import Any

from gyms.tau.store import Record
from gyms.tau2.store import RECORD, Tau2DB
from gyms.tau2.toolkit import ToolFn, toolkit

MODES = ("4g_5g_preferred", "4g_only", "3g_only", "2g_only")

MODE_TECH = {"4g_only": "4G", "3g_only": "3G", "2g_only": "2G"}

NETWORK_STATUSES = ("connected", "searching", "no_service", "emergency_only")

APN_NAMES = ("internet", "broken")

PERMISSIONS = ("sms", "storage", "phone", "network")

SIGNAL_ICON = {
    "none": "📵 No Signal",
    "poor": "📶¹ Poor",
    "fair": "📶² Fair",
    "good": "📶³ Good",
    "excellent": "📶⁴ Excellent",
}

TECH_SPEED = {"2G": (0.1, 0.4), "3G": (1.0, 5.0), "4G": (10.0, 100.0), "5G": (50.0, 500.0)}

SIGNAL_FACTOR = {"poor": 0.2, "fair": 0.5, "good": 0.8, "excellent": 1.0}

SPEED_ADVICE = {
    "Very Poor": "Connection is very slow. Basic web browsing might be difficult.",
    "Poor": "Connection is slow. Web browsing may be sluggish, streaming difficult.",
    "Fair": "Connection is okay for web browsing and some standard definition streaming.",
    "Good": "Connection is good for most activities, including HD streaming.",
    "Excellent": "Connection is very fast.",
}

SIM_TEXT = {
    "active": "Your SIM card is active and working.",
    "missing": "No SIM card detected in the phone.",
    "locked_pin": "The SIM card is locked with a PIN code.",
    "locked_puk": "The SIM card is locked with a PUK code.",
}

DEFAULT_VPN = {"server_address": "192.168.1.1", "protocol": "OpenVPN", "server_performance": "excellent"}

APN_DEFAULTS: Record = {
    "apn_name": "internet",
    "reset_at_reboot": False,
    "mms_apn": "mms",
    "mmsc_url": "http://mms.carrier.com/mms/wapenc",
    "mms_proxy": None,
    "mms_port": None,
}


# --- the phone: state logic ---


def _sim(phone: Record) -> str:
    return "missing" if phone["sim_card_missing"] else str(phone["sim_card_status"])


def _search(phone: Record, around: Record) -> None:
    """Network search: connect by SIM and mode preference; airplane mode, a broken APN or an inactive line cut it."""
    if _sim(phone) == "active":
        signals = around["signal_strength"]
        tech = MODE_TECH.get(phone["network_mode_preference"], "4G")
        if phone["network_mode_preference"] == "4g_5g_preferred" and signals.get("5G", "none") != "none":
            tech = "5G"
        phone["network_connection_status"] = "connected"
        phone["network_technology_connected"], phone["network_signal_strength"] = tech, signals.get(tech, "none")
    else:
        _no_service(phone)
    if phone["airplane_mode"] or phone["active_apn_settings"]["apn_name"] == "broken" or not around["line_active"]:
        _no_service(phone)


def _no_service(phone: Record) -> None:
    phone["network_connection_status"] = "no_service"
    phone["network_technology_connected"] = phone["network_signal_strength"] = "none"


def _bar(phone: Record) -> str:
    """The status bar's icons."""
    icons = []
    if phone["airplane_mode"]:
        icons.append("✈️ Airplane Mode")
    else:
        icons.append(SIGNAL_ICON.get(phone["network_signal_strength"], "📵 No Signal"))
        tech = phone["network_technology_connected"]
        if tech != "none":
            icons.append(str(tech))
        if phone["data_enabled"] and tech != "none":
            icons.append("📱 Data Enabled")
            if phone["data_saver_mode"]:
                icons.append("🔽 Data Saver")
        else:
            icons.append("📵 Data Disabled")
    if phone["wifi_enabled"] and phone["wifi_connected"]:
        icons.append(f"📡 Connected to {phone['wifi_ssid']}" if phone["wifi_ssid"] else "📡 Enabled")
    if phone["vpn_connected"]:
        icons.append("🔒 VPN Connected")
    icons.append(f"🔋 {phone['battery_level']}%")
    return " | ".join(icons)


def _with_bar(text: str, phone: Record) -> str:
    return f"{text}\nStatus Bar: {_bar(phone)}"


def _data_works(phone: Record, around: Record) -> bool:
    """Mobile data works: radio on, signal and service, roaming where abroad, data on, allowance left."""
    if phone["airplane_mode"] or phone["network_signal_strength"] == "none":
        return False
    if phone["network_connection_status"] == "no_service":
        return False
    if around["is_abroad"] and not (phone["roaming_enabled"] and around["roaming_allowed"]):
        return False
    return bool(phone["data_enabled"]) and not around["mobile_data_usage_exceeded"]


def _speed(phone: Record, around: Record) -> tuple[float | None, str]:
    """The speed test: mean of the technology's range, scaled by signal, a poor VPN and data saver."""
    if not _data_works(phone, around):
        return None, "No Connection"
    vpn = phone["vpn_details"]
    factor = 0.1 if phone["vpn_connected"] and vpn and vpn["server_performance"] == "poor" else 1.0
    if phone["data_saver_mode"]:
        factor *= 0.2
    low, high = TECH_SPEED.get(phone["network_technology_connected"], (0.0, 0.0))
    speed = round((low + high) / 2.0 * SIGNAL_FACTOR.get(phone["network_signal_strength"], 0.0) * factor, 2)
    for bound, label in ((1, "Very Poor"), (5, "Poor"), (25, "Fair"), (100, "Good")):
        if speed < bound:
            return speed, label
    return speed, "Excellent"


def _mms_works(phone: Record, around: Record) -> bool:
    """MMS works: mobile data on 3G or better, no MMS over Wi-Fi calling, an MMSC URL, SMS and storage."""
    if not _data_works(phone, around) or phone["network_technology_connected"] == "2G":
        return False
    if phone["wifi_calling_enabled"] and phone["wifi_calling_mms_over_wifi"]:
        return False
    if phone["active_apn_settings"]["mmsc_url"] is None:
        return False
    app = phone["app_statuses"].get("messaging")
    return app is not None and bool(app["permissions"]["storage"] and app["permissions"]["sms"])


def _read(db: Tau2DB) -> tuple[Record, Record]:
    """The phone and its surroundings, read-only."""
    return db["device"][RECORD], db["surroundings"][RECORD]


def _write(db: Tau2DB) -> tuple[Record, Record]:
    """The episode's own copy of the phone, and the surroundings read-only."""
    return db["device"].edit(RECORD), db["surroundings"][RECORD]


def _toggle_airplane(phone: Record, around: Record) -> bool:
    """Flip airplane mode. On: Wi-Fi and VPN drop. Off: searching, Wi-Fi drops if on. Then a search."""
    was_on = phone["airplane_mode"]
    phone["airplane_mode"] = not was_on
    if was_on:
        phone["network_connection_status"] = "searching"
    if not was_on or phone["wifi_enabled"]:
        phone["wifi_connected"], phone["wifi_ssid"], phone["wifi_signal_strength"] = False, None, "none"
    if not was_on and phone["vpn_connected"]:
        phone["vpn_connected"], phone["vpn_details"] = False, None
    _search(phone, around)
    return bool(phone["airplane_mode"])


def _toggle(db: Tau2DB, flag: str, search: bool) -> tuple[bool, Record]:
    """Flip a phone switch, searching the network again where upstream does; the new state and the phone."""
    phone, around = _write(db)
    phone[flag] = not phone[flag]
    if search:
        _search(phone, around)
    return bool(phone[flag]), phone


def _on_off(state: bool) -> str:
    return "ON" if state else "OFF"


def _granted(app: Record) -> list[str]:
    return [name.replace("_", " ").lower() for name, allowed in app["permissions"].items() if allowed]


# --- user tools (30) ---


def check_status_bar(db: Tau2DB) -> str:
    return f"Status Bar: {_bar(_read(db)[0])}"


def check_network_status(db: Tau2DB) -> str:
    phone = _read(db)[0]
    lines = [
        f"Airplane Mode: {_on_off(phone['airplane_mode'])}",
        f"SIM Card Status: {_sim(phone)}",
        f"Cellular Connection: {phone['network_connection_status']}",
        f"Cellular Signal: {phone['network_signal_strength']}",
        f"Cellular Network Type: {phone['network_technology_connected']}",
        f"Mobile Data Enabled: {'Yes' if phone['data_enabled'] else 'No'}",
        f"Data Roaming Enabled: {'Yes' if phone['roaming_enabled'] else 'No'}",
        f"Wi-Fi Radio: {_on_off(phone['wifi_enabled'])}",
        f"Wi-Fi Connected: {'Yes' if phone['wifi_connected'] else 'No'}",
    ]
    if phone["wifi_connected"]:
        lines.append(f"Connected Wi-Fi Network: {phone['wifi_ssid']}")
    return "\n".join(lines)


def check_network_mode_preference(db: Tau2DB) -> str:
    return f"Network Mode Preference: {_read(db)[0]['network_mode_preference']}"


def set_network_mode_preference(db: Tau2DB, mode: str) -> str:
    """Store a valid mode and search again; an invalid string is refused in text, not as an error."""
    phone = _read(db)[0]
    if not isinstance(mode, str) or mode in MODES:  # upstream stores a non-string as given
        phone, around = _write(db)
        phone["network_mode_preference"] = mode
        _search(phone, around)
    if isinstance(mode, str) and mode in MODES:
        return _with_bar(f"Preferred Network Mode set to: {mode}", phone)
    if mode is not None and not isinstance(mode, str):  # then fails on its `.value`
        raise AttributeError(f"'{type(mode).__name__}' object has no attribute 'value'")
    options = ", ".join(MODES)
    return _with_bar(f"Failed to set network mode: '{mode}' is not a valid option. Please use one of: {options}", phone)


def run_speed_test(db: Tau2DB) -> str:
    speed, label = _speed(*_read(db))
    if speed is None:
        return f"Speed test failed: {label}."
    return f"Speed Test Result: {speed:.2f} Mbps ({label}). {SPEED_ADVICE[label]}"


def toggle_airplane_mode(db: Tau2DB) -> str:
    """Flip airplane mode (see `_toggle_airplane`)."""
    phone, around = _write(db)
    return _with_bar(f"Airplane Mode is now {_on_off(_toggle_airplane(phone, around))}.", phone)


def check_sim_status(db: Tau2DB) -> str:
    return SIM_TEXT[_sim(_read(db)[0])]


def reseat_sim_card(db: Tau2DB) -> str:
    phone, around = _write(db)
    phone["sim_card_missing"] = False
    _search(phone, around)
    return _with_bar("SIM card re-seated successfully.", phone)


def toggle_data(db: Tau2DB) -> str:
    state, phone = _toggle(db, "data_enabled", search=True)
    return _with_bar(f"Mobile Data is now {_on_off(state)}.", phone)


def toggle_roaming(db: Tau2DB) -> str:
    state, phone = _toggle(db, "roaming_enabled", search=True)
    return _with_bar(f"Data Roaming is now {_on_off(state)}.", phone)


def check_data_restriction_status(db: Tau2DB) -> str:
    if _read(db)[0]["data_saver_mode"]:
        return "Data Saver mode is ON (limits data usage)."
    return "Data Saver mode is OFF."


def toggle_data_saver_mode(db: Tau2DB) -> str:
    state, phone = _toggle(db, "data_saver_mode", search=False)
    return _with_bar(f"Data Saver Mode is now {_on_off(state)}.", phone)


def check_apn_settings(db: Tau2DB) -> str:
    apn = _read(db)[0]["active_apn_settings"]
    return (
        f"Current APN Name: {apn['apn_name'] or 'Not Set'}\nMMSC URL (for picture messages): "
        f"{apn['mmsc_url'] or 'Not Set'}\n(These are technical settings, usually best left unchanged.)"
    )


def _apn(settings: Any) -> Record:
    """APN settings from a dict, validated as upstream's model (the error text keeps its first line only)."""
    if not isinstance(settings, dict):
        raise AttributeError(f"'{type(settings).__name__}' object has no attribute 'apn_name'")
    apn = {**APN_DEFAULTS, **settings}
    bad = [k for k in settings if k not in APN_DEFAULTS]
    bad += [] if apn["apn_name"] in APN_NAMES else ["apn_name"]
    if isinstance(apn["reset_at_reboot"], bool) or apn["reset_at_reboot"] in (0, 1):
        apn["reset_at_reboot"] = bool(apn["reset_at_reboot"])
    else:
        bad.append("reset_at_reboot")
    bad += [k for k in ("mms_apn", "mmsc_url", "mms_proxy") if not isinstance(apn[k], str | None)]
    port = apn["mms_port"]
    if isinstance(port, float) and port.is_integer():
        apn["mms_port"] = int(port)
    elif not (port is None or (isinstance(port, int) and not isinstance(port, bool))):
        bad.append("mms_port")
    if bad:
        raise ValueError(f"{len(bad)} validation error{'s' if len(bad) > 1 else ''} for APNSettings")
    return {k: apn[k] for k in APN_DEFAULTS}


def set_apn_settings(db: Tau2DB, apn_settings: Record) -> str:
    """Replace the APN settings, then search the network."""
    apn = _apn(apn_settings)
    phone, around = _write(db)
    phone["active_apn_settings"] = apn
    _search(phone, around)
    return _with_bar(f"APN settings set to: {apn['apn_name']}", phone)


def reset_apn_settings(db: Tau2DB) -> str:
    """Only marks the APN for reset: `reboot_device` applies it (quirk)."""
    phone, around = _write(db)
    phone["active_apn_settings"]["reset_at_reboot"] = True
    _search(phone, around)
    return _with_bar("APN settings will reset at reboot.", phone)


def check_wifi_status(db: Tau2DB) -> str:
    phone = _read(db)[0]
    if not phone["wifi_enabled"]:
        return "Wi-Fi is turned OFF."
    if phone["wifi_connected"]:
        return f"Wi-Fi is ON and connected to '{phone['wifi_ssid']}'. Signal strength: {phone['wifi_signal_strength']}."
    return "Wi-Fi is ON but not connected to any network."


def toggle_wifi(db: Tau2DB) -> str:
    """Flip the Wi-Fi radio (refused in airplane mode); it never joins a network."""
    if _read(db)[0]["airplane_mode"]:
        return _with_bar("Cannot change Wi-Fi settings while Airplane Mode is ON.", _read(db)[0])
    state, phone = _toggle(db, "wifi_enabled", search=False)
    if not state:
        phone["wifi_connected"], phone["wifi_ssid"], phone["wifi_signal_strength"] = False, None, "none"
    return _with_bar(f"Wi-Fi is now {_on_off(state)}.", phone)


def check_wifi_calling_status(db: Tau2DB) -> str:
    return f"Wi-Fi Calling is currently turned {_on_off(_read(db)[0]['wifi_calling_enabled'])}."


def toggle_wifi_calling(db: Tau2DB) -> str:
    state, phone = _toggle(db, "wifi_calling_enabled", search=False)
    return _with_bar(f"Wi-Fi Calling is now {_on_off(state)}.", phone)


def _vpn_repr(details: Record) -> str:
    """Python's repr of upstream's dumped VPN details (its performance is an enum member)."""
    level = details["server_performance"]
    member = f"<PerformanceLevel.{str(level).upper()}: {level!r}>"
    fields = f"'server_address': {details['server_address']!r}, 'protocol': {details['protocol']!r}"
    return f"{{{fields}, 'server_performance': {member}}}"


def check_vpn_status(db: Tau2DB) -> str:
    """Connected (with Python's repr of the details), enabled but not connected, or off."""
    phone = _read(db)[0]
    if phone["vpn_connected"]:
        if phone["vpn_details"]:
            return f"VPN is ON and connected. Details: {_vpn_repr(phone['vpn_details'])}"
        return "VPN is ON and connected (no specific details available)."
    if phone["vpn_enabled_setting"]:
        return "VPN is turned ON in settings, but currently not connected."
    return "VPN is turned OFF."


def connect_vpn(db: Tau2DB) -> str:
    """Connect with the default details, unless already connected."""
    if _read(db)[0]["vpn_connected"]:
        return "VPN already connected."
    phone = _write(db)[0]
    phone["vpn_connected"], phone["vpn_details"] = True, dict(DEFAULT_VPN)
    return _with_bar("VPN connected successfully.", phone)


def disconnect_vpn(db: Tau2DB) -> str:
    """Drop the VPN connection and its details."""
    if not _read(db)[0]["vpn_connected"]:
        return _with_bar("No active VPN connection to disconnect.", _read(db)[0])
    phone = _write(db)[0]
    phone["vpn_connected"], phone["vpn_details"] = False, None
    return _with_bar("VPN disconnected successfully.", phone)


def check_installed_apps(db: Tau2DB) -> str:
    return f"The following apps are installed on the phone: {', '.join(_read(db)[0]['app_statuses'])}"


def check_app_status(db: Tau2DB, app_name: str) -> str:
    app = _read(db)[0]["app_statuses"].get(app_name)
    if app is None:
        return f"App '{app_name}' not found on this phone."
    granted = _granted(app)
    lines = [f"Status for App: {app_name}"]
    lines += (
        [" - Permissions Granted:", *(f"   - {p}" for p in granted)] if granted else [" - Permissions: None granted."]
    )
    return "\n".join(lines)


def check_app_permissions(db: Tau2DB, app_name: str) -> str:
    app = _read(db)[0]["app_statuses"].get(app_name)
    if app is None:
        return f"App '{app_name}' not found on this phone."
    granted = _granted(app)
    if not granted:
        return f"App '{app_name}' currently has no permissions granted."
    return f"App '{app_name}' has permission for: {', '.join(granted)}."


def grant_app_permission(db: Tau2DB, app_name: str, permission: str) -> str:
    """Grant one of the tracked permissions; a refusal is text starting `Error.`, not an error observation."""
    phone = _read(db)[0]
    found = app_name in phone["app_statuses"]
    permission = permission.lower()
    if not found:
        message = f"Error. App '{app_name}' not found. Cannot grant permission."
    elif permission not in PERMISSIONS:
        tracked = f"available permissions: {list(PERMISSIONS)}"
        message = f"Error. Permission '{permission}' not tracked for app '{app_name}', {tracked}"
    else:
        phone = _write(db)[0]
        phone["app_statuses"][app_name]["permissions"][permission] = True
        message = f"Success. Permission '{permission}' granted to app '{app_name}'."
    return _with_bar(message, phone)


def can_send_mms(db: Tau2DB) -> str:
    """Whether the messaging app can send MMS (see `_mms_works`)."""
    if _mms_works(*_read(db)):
        return "Your messaging app can send MMS messages."
    return "Your messaging app cannot send MMS messages."


def reboot_device(db: Tau2DB) -> str:
    """Restart: a pending APN reset applies, then the network is searched again."""
    phone, around = _write(db)
    lines = []
    if phone["active_apn_settings"]["reset_at_reboot"]:
        lines.append("Resetting APN settings...")
        phone["active_apn_settings"] = dict(APN_DEFAULTS)
    lines.append("Restarting network services...")
    phone["network_connection_status"] = "searching"
    _search(phone, around)
    return _with_bar("\n".join(lines), phone)


def check_payment_request(db: Tau2DB) -> str:
    request = _read(db)[1]["payment_request"]
    if request is None:
        return "No payment request has been made."
    return f"You have a payment request for bill {request['bill_id']} of {request['amount_due']} USD."


def make_payment(db: Tau2DB) -> str:
    """Mark the request paid; the bill itself becomes `Paid` at the next sync (quirk)."""
    if _read(db)[1]["payment_request"] is None:
        return "You do not have a payment request."
    request = db["surroundings"].edit(RECORD)["payment_request"]
    request["paid"] = True
    return f"Payment of {request['amount_due']} USD has been made for bill {request['bill_id']}."


# --- user helpers (tasks only): setup, fault injection, assertions ---


def set_user_info(db: Tau2DB, name: str, phone_number: str) -> None:
    """Setup: who the user is; the sync finds the user's line by this phone number."""
    around = db["surroundings"].edit(RECORD)
    around["name"], around["phone_number"] = name, phone_number


def set_user_location(db: Tau2DB, abroad: bool) -> None:
    """Setup: abroad or at home (abroad, data needs roaming on the phone and on the line)."""
    db["surroundings"].edit(RECORD)["is_abroad"] = abroad


def simulate_network_search(db: Tau2DB) -> None:
    """Setup: search the network with the phone as it is."""
    _search(*_write(db))


def turn_airplane_mode_on(db: Tau2DB) -> str:
    """Fault: airplane mode on (toggled once, twice if it was on)."""
    if not _toggle_airplane(*_write(db)):
        _toggle_airplane(*_write(db))
    return "Airplane Mode is now ON."


def turn_airplane_mode_off(db: Tau2DB) -> str:
    """Setup: airplane mode off (toggled once, twice if it was off)."""
    if _toggle_airplane(*_write(db)):
        _toggle_airplane(*_write(db))
    return "Airplane Mode is now OFF."


def unseat_sim_card(db: Tau2DB) -> str:
    """Fault: the SIM card is out; no service."""
    phone, around = _write(db)
    phone["sim_card_missing"] = True
    _search(phone, around)
    return "SIM card un-seated successfully."


def lock_sim_card(db: Tau2DB, mode: str) -> str:
    """Fault: the SIM is locked by PIN or PUK (no tool unlocks it); no service."""
    phone, around = _write(db)
    if mode in ("pin", "puk"):
        phone["sim_card_status"] = f"locked_{mode}"
    _search(phone, around)
    return f"SIM card locked successfully in {mode} mode."


def turn_data_on(db: Tau2DB) -> str:
    """Data on without a network search, as upstream."""
    _write(db)[0]["data_enabled"] = True
    return "Data connection restored."


def _toggle_to(db: Tau2DB, setting: str, value: bool) -> None:
    """Upstream's fault and setup helpers: toggle `setting` (with a network search), and again if that left it
    not `value`; so a setting already at `value` is toggled twice."""
    if _toggle(db, setting, search=True)[0] != value:
        _toggle(db, setting, search=True)


def turn_data_off(db: Tau2DB) -> str:
    """Fault: mobile data off."""
    _toggle_to(db, "data_enabled", False)
    return "Data connection broken."


def turn_roaming_on(db: Tau2DB) -> str:
    """Setup: roaming on in the phone."""
    _toggle_to(db, "roaming_enabled", True)
    return "Data Roaming is now ON."


def turn_roaming_off(db: Tau2DB) -> str:
    """Fault: roaming off in the phone."""
    _toggle_to(db, "roaming_enabled", False)
    return "Data Roaming is now OFF."


def turn_data_saver_mode_on(db: Tau2DB) -> str:
    """Fault: data saver on (slow data)."""
    _write(db)[0]["data_saver_mode"] = True
    return "Data Saver Mode is now ON."


def turn_data_saver_mode_off(db: Tau2DB) -> str:
    """Setup: data saver off."""
    _write(db)[0]["data_saver_mode"] = False
    return "Data Saver Mode is now OFF."


def break_apn_settings(db: Tau2DB) -> str:
    """Fault: the APN is `broken`; no service until a reset and a reboot."""
    phone, around = _write(db)
    phone["active_apn_settings"]["apn_name"] = "broken"
    _search(phone, around)
    return "APN settings broken. Please call reset_apn_settings() to fix."


def break_apn_mms_setting(db: Tau2DB) -> str:
    """Fault: no MMSC URL; no MMS until a reset and a reboot."""
    _write(db)[0]["active_apn_settings"]["mmsc_url"] = None
    return "APN MMS setting broken. Please call reset_apn_settings() to fix."


def set_wifi_calling(db: Tau2DB, enabled: bool, mms_over_wifi: bool | None = None) -> str:
    """Setup or fault: Wi-Fi calling, and MMS over Wi-Fi if given (both on: no MMS)."""
    phone = _write(db)[0]
    if phone["wifi_calling_enabled"] != enabled:
        phone["wifi_calling_enabled"] = not phone["wifi_calling_enabled"]
    message = f"Wi-Fi Calling is now {_on_off(enabled)}."
    if mms_over_wifi is not None:
        phone["wifi_calling_mms_over_wifi"] = mms_over_wifi
        message += f"\nMMS over Wi-Fi is now {_on_off(mms_over_wifi)}."
    return message


def break_vpn(db: Tau2DB) -> str:
    """Connect the VPN (if not connected) and make its server poor: slow data."""
    connect_vpn(db)
    phone = _write(db)[0]
    phone["vpn_details"] = {**phone["vpn_details"], "server_performance": "poor"}
    return "VPN connection broken."


def remove_app_permission(db: Tau2DB, app_name: str, permission: str) -> tuple[bool, str]:
    """Fault: revoke an app's permission; returns whether it did, and why not."""
    permission = permission.lower()
    if app_name not in _read(db)[0]["app_statuses"]:
        return False, f"App '{app_name}' not found. Cannot remove permission."
    if permission not in PERMISSIONS:
        return False, f"Permission '{permission}' not tracked for app '{app_name}'."
    _write(db)[0]["app_statuses"][app_name]["permissions"][permission] = False
    return True, f"Permission '{permission}' removed from app '{app_name}'."


def assert_service_status(db: Tau2DB, expected_status: str) -> bool:
    """The phone's connection status is `expected_status` (an unknown status raises)."""
    if expected_status not in NETWORK_STATUSES:
        raise ValueError(f"'{expected_status}' is not a valid NetworkStatus")
    return bool(_read(db)[0]["network_connection_status"] == expected_status)


def assert_mobile_data_status(db: Tau2DB, expected_status: bool) -> bool:
    """Whether mobile data works is `expected_status`."""
    return _data_works(*_read(db)) == expected_status


def assert_internet_speed(db: Tau2DB, expected_speed: float, expected_desc: str | None = None) -> bool:
    """The speed test gives at least `expected_speed`, and the label `expected_desc` if given."""
    speed, label = _speed(*_read(db))
    fast = (speed or 0.0) >= expected_speed
    return fast if expected_desc is None else fast and label.lower() == expected_desc.lower()


def assert_internet_not_excellent(db: Tau2DB) -> bool:
    """The speed test's label is not Excellent (no connection counts as not)."""
    return _speed(*_read(db))[1].lower() != "excellent"


def assert_can_send_mms(db: Tau2DB, expected_status: bool) -> bool:
    """Whether MMS works is `expected_status`."""
    return _mms_works(*_read(db)) == expected_status


def assert_airplane_mode_status(db: Tau2DB, expected_status: bool) -> bool:
    return bool(_read(db)[0]["airplane_mode"] == expected_status)


def assert_mobile_roaming_status(db: Tau2DB, expected_status: bool) -> bool:
    return bool(_read(db)[0]["roaming_enabled"] == expected_status)


def assert_mobile_data_saver_mode_status(db: Tau2DB, expected_status: bool) -> bool:
    return bool(_read(db)[0]["data_saver_mode"] == expected_status)


def assert_mobile_data_usage_exceeded(db: Tau2DB, expected_status: bool) -> bool:
    return bool(_read(db)[1]["mobile_data_usage_exceeded"] == expected_status)


USER_TOOLS: dict[str, ToolFn] = toolkit(
    "TelecomUserTools",
    (
        check_status_bar, check_network_status, check_network_mode_preference, set_network_mode_preference,
        run_speed_test, toggle_airplane_mode, check_sim_status, reseat_sim_card, toggle_data, toggle_roaming,
        check_data_restriction_status, toggle_data_saver_mode, check_apn_settings, set_apn_settings,
        reset_apn_settings, check_wifi_status, toggle_wifi, check_wifi_calling_status, toggle_wifi_calling,
        check_vpn_status, connect_vpn, disconnect_vpn, check_installed_apps, check_app_status, check_app_permissions,
        grant_app_permission, can_send_mms, reboot_device, check_payment_request, make_payment,
    ),
)  # fmt: skip
USER_WRITE_TOOLS = frozenset(
    {
        "set_network_mode_preference", "toggle_airplane_mode", "reseat_sim_card", "toggle_data", "toggle_roaming",
        "toggle_data_saver_mode", "set_apn_settings", "reset_apn_settings", "toggle_wifi", "toggle_wifi_calling",
        "connect_vpn", "disconnect_vpn", "grant_app_permission", "reboot_device", "make_payment",
    }
)  # fmt: skip
USER_HELPERS: dict[str, ToolFn] = toolkit(
    "TelecomUserTools",
    (
        set_user_info, set_user_location, simulate_network_search, turn_airplane_mode_on, turn_airplane_mode_off,
        unseat_sim_card, lock_sim_card, turn_data_on, turn_data_off, turn_roaming_on, turn_roaming_off,
        turn_data_saver_mode_on, turn_data_saver_mode_off, break_apn_settings, break_apn_mms_setting,
        set_wifi_calling, break_vpn, remove_app_permission, assert_service_status, assert_mobile_data_status,
        assert_internet_speed, assert_internet_not_excellent, assert_can_send_mms, assert_airplane_mode_status,
        assert_mobile_roaming_status, assert_mobile_data_saver_mode_status, assert_mobile_data_usage_exceeded,
    ),
)  # fmt: skip
