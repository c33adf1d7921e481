"""The real-model task's reward (``train_configs/smollm2_capitals_cpu.toml``), written as TRL writes reward functions,
and the task's data (``scripts/make_capitals.py`` writes ``data/capitals`` from ``CAPITALS``).

``capital_reward``: 1.0 when the completion names the record's capital and no other capital of ``CAPITALS`` (so
listing capitals earns nothing), else 0.0; case-insensitive, whole words.
"""

import re

CAPITALS = {
    "Afghanistan": "Kabul", "Albania": "Tirana", "Algeria": "Algiers", "Angola": "Luanda", "Argentina": "Buenos Aires",
    "Armenia": "Yerevan", "Australia": "Canberra", "Austria": "Vienna", "Azerbaijan": "Baku", "Bangladesh": "Dhaka",
    "Belarus": "Minsk", "Belgium": "Brussels", "Bolivia": "Sucre", "Brazil": "Brasilia", "Bulgaria": "Sofia",
    "Cambodia": "Phnom Penh", "Cameroon": "Yaounde", "Canada": "Ottawa", "Chile": "Santiago", "China": "Beijing",
    "Colombia": "Bogota", "Croatia": "Zagreb", "Cuba": "Havana", "Cyprus": "Nicosia", "Czechia": "Prague",
    "Denmark": "Copenhagen", "Ecuador": "Quito", "Egypt": "Cairo", "Estonia": "Tallinn", "Ethiopia": "Addis Ababa",
    "Finland": "Helsinki", "France": "Paris", "Georgia": "Tbilisi", "Germany": "Berlin", "Ghana": "Accra",
    "Greece": "Athens", "Guatemala": "Guatemala City", "Hungary": "Budapest", "Iceland": "Reykjavik",
    "India": "New Delhi", "Indonesia": "Jakarta", "Iran": "Tehran", "Iraq": "Baghdad", "Ireland": "Dublin",
    "Israel": "Jerusalem", "Italy": "Rome", "Jamaica": "Kingston", "Japan": "Tokyo", "Jordan": "Amman",
    "Kazakhstan": "Astana", "Kenya": "Nairobi", "Kuwait": "Kuwait City", "Laos": "Vientiane", "Latvia": "Riga",
    "Lebanon": "Beirut", "Libya": "Tripoli", "Lithuania": "Vilnius", "Luxembourg": "Luxembourg",
    "Madagascar": "Antananarivo", "Malaysia": "Kuala Lumpur", "Mali": "Bamako", "Malta": "Valletta",
    "Mexico": "Mexico City", "Mongolia": "Ulaanbaatar", "Morocco": "Rabat", "Mozambique": "Maputo",
    "Nepal": "Kathmandu", "the Netherlands": "Amsterdam", "New Zealand": "Wellington", "Nicaragua": "Managua",
    "Nigeria": "Abuja", "North Korea": "Pyongyang", "Norway": "Oslo", "Oman": "Muscat", "Pakistan": "Islamabad",
    "Panama": "Panama City", "Paraguay": "Asuncion", "Peru": "Lima", "the Philippines": "Manila", "Poland": "Warsaw",
    "Portugal": "Lisbon", "Qatar": "Doha", "Romania": "Bucharest", "Russia": "Moscow", "Saudi Arabia": "Riyadh",
    "Senegal": "Dakar", "Serbia": "Belgrade", "Singapore": "Singapore", "Slovakia": "Bratislava",
    "Slovenia": "Ljubljana", "Somalia": "Mogadishu", "South Africa": "Pretoria", "South Korea": "Seoul",
    "Spain": "Madrid", "Sri Lanka": "Colombo", "Sudan": "Khartoum", "Sweden": "Stockholm", "Switzerland": "Bern",
    "Syria": "Damascus", "Taiwan": "Taipei", "Tanzania": "Dodoma", "Thailand": "Bangkok", "Tunisia": "Tunis",
    "Turkey": "Ankara", "Uganda": "Kampala", "Ukraine": "Kyiv", "the United Kingdom": "London",
    "the United States": "Washington", "Uruguay": "Montevideo", "Uzbekistan": "Tashkent", "Venezuela": "Caracas",
    "Vietnam": "Hanoi", "Yemen": "Sanaa", "Zambia": "Lusaka", "Zimbabwe": "Harare",
}

_PATTERNS = {c: re.compile(r"\b" + re.escape(c.lower()) + r"\b") for c in set(CAPITALS.values())}


def capital_reward(completions, answer, **kwargs):
    """1.0 when the completion names ``answer`` and no other capital, else 0.0."""
    out = []
    for completion, gold in zip(completions, answer):
        text = (completion[-1]["content"] if isinstance(completion, list) else completion).lower()
        named = {c for c, p in _PATTERNS.items() if p.search(text)}
        out.append(1.0 if named == {gold} else 0.0)
    return out
