// Files (moe_echo/host_io.hpp): stdio under the hood, errno read right after the call that
// failed, so every message says which path and why.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"

namespace moe_echo {
namespace {

[[noreturn]] void fail(const char* verb, const std::string& path, int err) {
  const std::string reason = err != 0 ? std::strerror(err) : "unknown error";
  throw FileError(path, reason, std::string("cannot ") + verb + " '" + path + "': " + reason);
}

bool is_dir(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

OutputFile::OutputFile(std::string path) : path_(std::move(path)) {
  errno = 0;
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_) fail("write", path_, errno);
}

OutputFile::~OutputFile() {
  if (file_) (void)std::fclose(file_);
}

void OutputFile::write(std::string_view bytes) {
  if (!file_) fail("write", path_, EBADF);  // closed
  errno = 0;
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size())
    fail("write", path_, errno);
}

void OutputFile::close() {
  if (!file_) return;
  std::FILE* f = file_;
  file_ = nullptr;
  errno = 0;
  const bool flushed = std::fflush(f) == 0 && !std::ferror(f);
  const int flush_err = errno;
  errno = 0;
  const bool closed = std::fclose(f) == 0;
  if (!flushed) fail("write", path_, flush_err);
  if (!closed) fail("write", path_, errno);
}

void write_file(const std::string& path, std::string_view bytes) {
  OutputFile f(path);
  f.write(bytes);
  f.close();
}

std::string read_file(const std::string& path) {
  if (is_dir(path)) fail("read", path, EISDIR);
  errno = 0;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail("read", path, errno);
  std::string out;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  const int err = std::ferror(f) ? (errno != 0 ? errno : EIO) : 0;
  (void)std::fclose(f);
  if (err != 0) fail("read", path, err);
  return out;
}

void check_output_path(const std::string& field, const std::string& path) {
  if (path.empty()) return;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) reject(field, "'" + path + "'", "a file path, not a folder");
    if (::access(path.c_str(), W_OK) != 0)
      reject(field, "'" + path + "'", "a file this user may write (it is read-only)");
    return;
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  if (!is_dir(dir))
    reject(field, "'" + path + "'", "a path in an existing folder ('" + dir + "' is none)");
  if (::access(dir.c_str(), W_OK) != 0)
    reject(field, "'" + path + "'", "a path in a folder this user may write ('" + dir + "')");
}

void check_output_dir(const std::string& field, const std::string& dir) {
  if (!is_dir(dir)) reject(field, "'" + dir + "'", "an existing folder");
  if (::access(dir.c_str(), W_OK) != 0)
    reject(field, "'" + dir + "'", "a folder this user may write");
}

}  // namespace moe_echo
