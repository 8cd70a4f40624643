# ruff: noqa  -- kept as it ran (from bench_tmp/), issue 23 item 1 anchor, 2026-11-28
"""Replace DeepGEMM's three std::regex uses (they crash in this image's libstdc++ when built as a torch extension:
SIGSEGV in std::regex's compiler) with plain string scans. Run in the DeepGEMM source root."""
from pathlib import Path

inc = Path("csrc/jit/include_parser.hpp")
s = inc.read_text()
start = s.index("        const std::regex pattern(")
end = s.index("        return includes;")
s = s[:start] + """        // Plain scan (std::regex crashed in this build): every `#include <...>` or `#include "..."` line.
        size_t pos = 0;
        while ((pos = code.find("#", pos)) != std::string::npos) {
            size_t p = pos + 1;
            while (p < code.size() and (code[p] == ' ' or code[p] == '\\t')) ++ p;
            if (code.compare(p, 7, "include") != 0) { pos = p; continue; }
            p += 7;
            while (p < code.size() and (code[p] == ' ' or code[p] == '\\t')) ++ p;
            if (p >= code.size() or (code[p] != '<' and code[p] != '"')) { pos = p; continue; }
            const size_t close = code.find_first_of(">\\"", p + 1);
            if (close == std::string::npos) break;
            const std::string include_str = code.substr(pos, close + 1 - pos);
            pos = close + 1;
            const int len = include_str.length();
            if (include_str.substr(0, 10) == "#include <" and include_str[len - 1] == '>' and include_str[10] != ' ' and include_str[len - 2] != ' ') {
                std::string filename = include_str.substr(10, len - 11);
                if (filename.substr(0, 9) == "deep_gemm")
                    includes.push_back(filename);
            } else {
                std::string error_info = fmt::format("Non-standard include: {}", include_str);
                if (file_path != "")
                    error_info += fmt::format(" ({})", file_path.string());
                DG_HOST_UNREACHABLE(error_info);
            }
        }
""" + s[end:]
inc.write_text(s)

comp = Path("csrc/jit/compiler.hpp")
s = comp.read_text()
old = """        std::smatch match;
        DG_HOST_ASSERT(std::regex_search(output, match, std::regex(R"(release (\\d+\\.\\d+))")));
        std::sscanf(match[1].str().c_str(), "%d.%d", &major, &minor);"""
assert old in s
s = s.replace(old, """        const auto release = output.find("release ");
        DG_HOST_ASSERT(release != std::string::npos);
        DG_HOST_ASSERT(std::sscanf(output.c_str() + release + 8, "%d.%d", &major, &minor) == 2);""")
old = 'DG_HOST_ASSERT(not std::regex_search(output, std::regex(R"(Local memory used)")));'
assert old in s
s = s.replace(old, 'DG_HOST_ASSERT(output.find("Local memory used") == std::string::npos);')
comp.write_text(s)
print("patched")
