#include "data/pii.h"

#include <algorithm>
#include <vector>

namespace pollen::data {
namespace {

inline bool digit(char c) {
  return c >= '0' && c <= '9';
}
inline bool alpha(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}
inline bool alnum(char c) {
  return digit(c) || alpha(c);
}
inline bool hexd(char c) {
  return digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}
inline bool word_char(char c) {
  return alnum(c) || c == '_';
}

struct Span {
  size_t b, e;
  PiiType type;
};

// ---- email ---------------------------------------------------------------------------------
inline bool local_char(char c) {
  return alnum(c) || c == '.' || c == '_' || c == '%' || c == '+' || c == '-';
}
void find_emails(std::string_view s, std::vector<Span>& out) {
  for (size_t at = s.find('@'); at != std::string_view::npos; at = s.find('@', at + 1)) {
    size_t b = at;
    while (b > 0 && local_char(s[b - 1])) --b;
    while (b < at && s[b] == '.') ++b;
    if (b == at) continue;
    size_t e = at + 1, last_dot = 0;
    while (e < s.size() && (alnum(s[e]) || s[e] == '-' || s[e] == '.')) {
      if (s[e] == '.') last_dot = e;
      ++e;
    }
    while (e > at + 1 && (s[e - 1] == '.' || s[e - 1] == '-')) --e;
    if (last_dot >= e - 1 || last_dot <= at + 1) {
      // recompute the last dot inside [at+1, e)
      last_dot = 0;
      for (size_t k = at + 1; k < e; ++k)
        if (s[k] == '.') last_dot = k;
    }
    if (last_dot == 0 || last_dot <= at + 1 || e - last_dot - 1 < 2) continue;
    bool tld_alpha = true;
    for (size_t k = last_dot + 1; k < e; ++k) tld_alpha &= alpha(s[k]);
    if (!tld_alpha) continue;
    out.push_back({b, e, PiiType::email});
  }
}

// ---- IP addresses --------------------------------------------------------------------------
bool preceded_by_version(std::string_view s, size_t b) {
  if (b > 0 && (s[b - 1] == 'v' || s[b - 1] == 'V')) return true;
  size_t k = b;
  while (k > 0 && (s[k - 1] == ' ')) --k;
  size_t w = k;
  while (w > 0 && alpha(s[w - 1])) --w;
  std::string word(s.substr(w, k - w));
  std::transform(word.begin(), word.end(), word.begin(),
                 [](char c) { return static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c); });
  return word == "version" || word == "ver" || word == "release" || word == "v";
}

void find_ipv4(std::string_view s, std::vector<Span>& out) {
  for (size_t i = 0; i < s.size(); ++i) {
    if (!digit(s[i]) || (i > 0 && (digit(s[i - 1]) || s[i - 1] == '.' || alpha(s[i - 1]))))
      continue;
    size_t p = i;
    int parts = 0;
    bool ok = true;
    while (parts < 4) {
      size_t q = p;
      while (q < s.size() && digit(s[q]) && q - p < 4) ++q;
      size_t len = q - p;
      if (len == 0 || len > 3 || (len > 1 && s[p] == '0')) {
        ok = false;
        break;
      }
      int v = std::stoi(std::string(s.substr(p, len)));
      if (v > 255) {
        ok = false;
        break;
      }
      ++parts;
      p = q;
      if (parts < 4) {
        if (p + 1 < s.size() && s[p] == '.' && digit(s[p + 1]))
          ++p;
        else {
          ok = false;
          break;
        }
      }
    }
    if (!ok || parts != 4) continue;
    // Not part of a longer dotted or alphanumeric run.
    if (p < s.size() && (word_char(s[p]) || (s[p] == '.' && p + 1 < s.size() && digit(s[p + 1]))))
      continue;
    if (preceded_by_version(s, i)) continue;
    out.push_back({i, p, PiiType::ip});
    i = p;
  }
}

void find_ipv6(std::string_view s, std::vector<Span>& out) {
  for (size_t i = 0; i < s.size(); ++i) {
    if (!(hexd(s[i]) || s[i] == ':')) continue;
    if (i > 0 && (word_char(s[i - 1]) || s[i - 1] == ':' || s[i - 1] == '.')) continue;
    size_t e = i;
    while (e < s.size() && (hexd(s[e]) || s[e] == ':')) ++e;
    // Optional embedded IPv4 tail is not handled; trim a trailing single colon.
    std::string_view c = s.substr(i, e - i);
    if (e < s.size() && (word_char(s[e]) || (s[e] == '.' && e + 1 < s.size() && hexd(s[e + 1]))))
      continue;
    while (!c.empty() && c.back() == ':' && !(c.size() >= 2 && c[c.size() - 2] == ':'))
      c.remove_suffix(1);
    size_t dbl = c.find("::");
    if (dbl != std::string_view::npos && c.find("::", dbl + 1) != std::string_view::npos) continue;
    int groups = 0;
    bool ok = true, letter = false, number = false;
    size_t p = 0;
    while (p < c.size()) {
      if (c[p] == ':') {
        ++p;
        continue;
      }
      size_t q = p;
      while (q < c.size() && hexd(c[q])) {
        letter |= !digit(c[q]);
        number |= digit(c[q]);
        ++q;
      }
      if (q - p > 4) ok = false;
      ++groups;
      p = q;
    }
    if (c.find(":::") != std::string_view::npos) ok = false;
    if (!ok) continue;
    bool full = dbl == std::string_view::npos && groups == 8;
    bool compressed = dbl != std::string_view::npos && groups >= 1 && groups <= 7 &&
                      (groups >= 2 || letter || c.size() >= 3);
    // "::" alone and scopes in code ("A::B", "cb::add", "Face::Add": hex letters only) are not
    // addresses: a compressed one needs a digit and two groups, or is ::1.
    if (!(full || (compressed && number && (groups >= 2 || c == "::1")))) continue;
    out.push_back({i, i + c.size(), PiiType::ip});
    i = e;
  }
}

// ---- digit runs: cards and phones ------------------------------------------------------------
bool luhn(std::string_view d) {
  int sum = 0;
  bool dbl = false;
  for (size_t k = d.size(); k-- > 0;) {
    int v = d[k] - '0';
    if (dbl) {
      v *= 2;
      if (v > 9) v -= 9;
    }
    sum += v;
    dbl = !dbl;
  }
  return sum % 10 == 0;
}

// A run of digit groups: digits, separated by single ' ', '-', '.', or wrapped "(ddd)".
struct Run {
  size_t b, e;
  std::string digits;
  std::vector<int> groups;
  bool plus = false, paren = false;
  char sep = 0;
  bool mixed_sep = false;
};

void find_digit_runs(std::string_view s, std::vector<Run>& runs) {
  for (size_t i = 0; i < s.size(); ++i) {
    bool start_plus = s[i] == '+' && i + 1 < s.size() && digit(s[i + 1]);
    bool start_paren = s[i] == '(' && i + 1 < s.size() && digit(s[i + 1]);
    if (!(digit(s[i]) || start_plus || start_paren)) continue;
    if (i > 0 && (word_char(s[i - 1]) || s[i - 1] == '.' || s[i - 1] == '-' || s[i - 1] == '/' ||
                  s[i - 1] == '#' || s[i - 1] == '+'))
      continue;
    Run r;
    r.b = i;
    size_t p = i;
    if (start_plus) {
      r.plus = true;
      ++p;
    }
    while (p < s.size()) {
      bool paren = false;
      if (s[p] == '(') {
        paren = true;
        ++p;
      }
      size_t q = p;
      while (q < s.size() && digit(s[q])) ++q;
      if (q == p) break;
      r.digits.append(s.substr(p, q - p));
      r.groups.push_back(static_cast<int>(q - p));
      p = q;
      if (paren) {
        if (p < s.size() && s[p] == ')') {
          r.paren = true;
          ++p;
        } else {
          break;
        }
      }
      // A separator continues the run only when a digit (or "(digit") follows.
      size_t k = p;
      if (k < s.size() && (s[k] == ' ' || s[k] == '-' || s[k] == '.')) {
        char sp = s[k];
        if (k + 1 < s.size() && (digit(s[k + 1]) || s[k + 1] == '(')) {
          if (r.sep && r.sep != sp) r.mixed_sep = true;
          if (!(r.paren && sp == ' ' && r.groups.size() == 1)) r.sep = r.sep ? r.sep : sp;
          p = k + 1;
          continue;
        }
      } else if (r.paren && k < s.size() && digit(s[k])) {
        continue;
      }
      break;
    }
    r.e = p;
    // Drop a trailing separator consumed before a non-digit.
    while (r.e > r.b && !digit(s[r.e - 1]) && s[r.e - 1] != ')') --r.e;
    const bool glued =
        r.e < s.size() &&
        (word_char(s[r.e]) || (s[r.e] == '.' && r.e + 1 < s.size() && digit(s[r.e + 1])));
    if (!glued) runs.push_back(std::move(r));
    // A run that starts inside this one ends where it ends, and is dropped or kept alike: the
    // scan goes on past it (starting again at each group made glued runs quadratic).
    i = std::max(i, p > 0 ? p - 1 : p);
  }
}

bool card_like(const Run& r) {
  size_t n = r.digits.size();
  if (n < 13 || n > 19 || r.plus || r.paren || r.mixed_sep) return false;
  if (r.sep == '.') return false;
  char f = r.digits[0];
  if (f < '2' || f > '6') return false;
  if (r.groups.size() > 1) {
    // Groups of 4 (the last may be shorter), or Amex 4-6-5.
    bool fours = true;
    for (size_t k = 0; k + 1 < r.groups.size(); ++k) fours &= r.groups[k] == 4;
    bool amex = r.groups.size() == 3 && r.groups[0] == 4 && r.groups[1] == 6 && r.groups[2] == 5;
    if (!fours && !amex) return false;
  }
  return luhn(r.digits);
}

bool phone_like(const Run& r) {
  size_t n = r.digits.size();
  if (n < 10 || n > 15) return false;
  if (r.groups.size() < 2 && !r.plus) return false;  // a bare digit string is an order number
  if (!r.plus && !r.paren) {
    // National forms only: North American 3-3-4 (optionally 1-3-3-4), or a trunk prefix 0
    // with groups of 2-4 digits (020 7946 0958, 06 12 34 56 78).
    const auto& g = r.groups;
    bool nanp = (g == std::vector<int>{3, 3, 4}) ||
                (g == std::vector<int>{1, 3, 3, 4} && r.digits[0] == '1');
    bool trunk = r.digits[0] == '0' && n <= 11;
    for (int x : g) trunk &= x >= 2 && x <= 4;
    return nanp || trunk;
  }
  size_t first = 0;
  if (r.plus) {
    if (r.groups[0] > 3) return r.groups.size() == 1 && n >= 10;  // +15551234567
    first = 1;
  }
  for (size_t k = first; k < r.groups.size(); ++k) {
    int g = r.groups[k];
    bool last = k + 1 == r.groups.size();
    if (g < 2 && !(r.plus && k == first)) return false;
    if (g > 4 && !(last && g <= 5)) return false;
  }
  // Dates like 2023.01.15.10 or ISBN-like runs with 1-digit groups are excluded above.
  return true;
}

// ---- IBAN ----------------------------------------------------------------------------------
void find_ibans(std::string_view s, std::vector<Span>& out) {
  for (size_t i = 0; i + 15 <= s.size(); ++i) {
    if (!(s[i] >= 'A' && s[i] <= 'Z' && s[i + 1] >= 'A' && s[i + 1] <= 'Z' && digit(s[i + 2]) &&
          digit(s[i + 3])))
      continue;
    if (i > 0 && word_char(s[i - 1])) continue;
    std::string compact(s.substr(i, 4));
    size_t p = i + 4, end = p;
    while (p < s.size() && compact.size() < 34) {
      if ((s[p] >= 'A' && s[p] <= 'Z') || digit(s[p])) {
        compact += s[p++];
        end = p;
      } else if (s[p] == ' ' && p + 1 < s.size() &&
                 ((s[p + 1] >= 'A' && s[p + 1] <= 'Z') || digit(s[p + 1]))) {
        ++p;
      } else {
        break;
      }
    }
    // Try the longest valid prefix (groups may be followed by other words).
    for (size_t len = compact.size(); len >= 15; --len) {
      if (iban_valid(compact.substr(0, len))) {
        // Map len compact characters back to the end position in s.
        size_t q = i, taken = 0;
        while (taken < len) {
          if (s[q] != ' ') ++taken;
          ++q;
        }
        if (q < s.size() && word_char(s[q]) && q < end) break;  // cut inside a group
        out.push_back({i, q, PiiType::iban});
        i = q;
        break;
      }
    }
  }
}

}  // namespace

const char* pii_type_name(PiiType t) {
  static const char* names[] = {"email", "ip", "phone", "credit_card", "iban"};
  return names[static_cast<int>(t)];
}
const char* pii_placeholder(PiiType t) {
  static const char* names[] = {"<EMAIL>", "<IP_ADDRESS>", "<PHONE>", "<CREDIT_CARD>", "<IBAN>"};
  return names[static_cast<int>(t)];
}

int64_t PiiCounts::total() const {
  int64_t t = 0;
  for (auto v : n) t += v;
  return t;
}

bool luhn_valid(std::string_view digits) {
  return luhn(digits);
}

bool iban_valid(std::string_view c) {
  if (c.size() < 15 || c.size() > 34) return false;
  if (!(alpha(c[0]) && alpha(c[1]) && digit(c[2]) && digit(c[3]))) return false;
  int mod = 0;
  auto feed = [&](char ch) {
    if (digit(ch)) {
      mod = (mod * 10 + (ch - '0')) % 97;
    } else if (ch >= 'A' && ch <= 'Z') {
      int v = ch - 'A' + 10;
      mod = (mod * 100 + v) % 97;
    } else {
      mod = -1000000;
    }
  };
  for (size_t k = 4; k < c.size(); ++k) feed(c[k]);
  for (size_t k = 0; k < 4; ++k) feed(c[k]);
  return mod == 1;
}

PiiCounts redact_pii(std::string_view s, const PiiOptions& o, std::string& out) {
  std::vector<Span> spans;
  auto on = [&](PiiType t) { return o.types[static_cast<int>(t)]; };
  // Quick rejection: most documents have no '@', no ':' and few digits.
  bool has_at = false, has_digit = false, has_colon = false;
  for (char c : s) {
    has_at |= c == '@';
    has_digit |= digit(c);
    has_colon |= c == ':';
  }
  if (on(PiiType::email) && has_at) find_emails(s, spans);
  if (on(PiiType::iban) && has_digit) find_ibans(s, spans);
  if (on(PiiType::ip) && has_digit) find_ipv4(s, spans);
  if (on(PiiType::ip) && has_colon) find_ipv6(s, spans);
  if (has_digit && (on(PiiType::credit_card) || on(PiiType::phone))) {
    std::vector<Run> runs;
    find_digit_runs(s, runs);
    for (const auto& r : runs) {
      if (on(PiiType::credit_card) && card_like(r))
        spans.push_back({r.b, r.e, PiiType::credit_card});
      else if (on(PiiType::phone) && phone_like(r))
        spans.push_back({r.b, r.e, PiiType::phone});
    }
  }
  PiiCounts counts;
  out.clear();
  if (spans.empty()) {
    out.assign(s);
    return counts;
  }
  // Earlier spans win; on equal starts the longer one (order of detection breaks ties).
  std::stable_sort(spans.begin(), spans.end(),
                   [](const Span& a, const Span& b) { return a.b != b.b ? a.b < b.b : a.e > b.e; });
  size_t at = 0;
  for (const auto& sp : spans) {
    if (sp.b < at) continue;
    out.append(s.substr(at, sp.b - at));
    out += pii_placeholder(sp.type);
    counts.n[static_cast<int>(sp.type)]++;
    at = sp.e;
  }
  out.append(s.substr(at));
  return counts;
}

}  // namespace pollen::data
