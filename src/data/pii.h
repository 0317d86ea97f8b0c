#pragma once
// PII redaction with typed placeholders. Detectors are hand-written scanners (no regex engine):
//   email        local@domain.tld                                        -> <EMAIL>
//   ip           IPv4 (four 0-255 parts, no leading zeros) and IPv6      -> <IP_ADDRESS>
//   phone        +CC groups or 3-3-4 style numbers with separators,      -> <PHONE>
//                10 to 15 digits
//   credit_card  13-19 digits (groups split by one space or dash),       -> <CREDIT_CARD>
//                issuer prefix 2-6 and a valid Luhn check digit
//   iban         country code, check digits, 11-30 letters/digits,       -> <IBAN>
//                ISO 13616 mod-97 check
// Look-alikes are rejected: version strings (v1.2.3.4, "version 1.2.3.4"), dates, times,
// ISBNs and long unseparated order numbers.
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace pollen::data {

enum class PiiType { email, ip, phone, credit_card, iban };
inline constexpr int kPiiTypes = 5;
const char* pii_type_name(PiiType t);
const char* pii_placeholder(PiiType t);

struct PiiOptions {
  bool enabled = true;
  std::array<bool, kPiiTypes> types{true, true, true, true, true};
};

struct PiiCounts {
  std::array<int64_t, kPiiTypes> n{};
  int64_t total() const;
};

// Writes `text` with each detected item replaced by its placeholder; returns the counts.
PiiCounts redact_pii(std::string_view text, const PiiOptions& options, std::string& out);

bool luhn_valid(std::string_view digits);
bool iban_valid(std::string_view compact);  // letters and digits only, upper case

}  // namespace pollen::data
